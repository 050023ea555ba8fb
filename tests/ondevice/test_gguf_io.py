"""GGUF export/import: metadata, layout, round trip, tokenizer, and clear errors on bad files."""
import os

import jax
import numpy as np
import pytest

from framework import names
from ondevice import gguf_io
from ondevice.tokenizer import SPACE_PIECE, ByteTokenizer


def test_header_config_and_types(tiny, files):
  cfg = tiny[0]
  for q, path in files.items():
    info = gguf_io.read_info(path)
    assert info.cfg == cfg and info.byte_tokenizer and info.alignment == 4096
    types = {t.qtype for t in info.tensors.values()}
    assert types == ({"F32"} if q == "f32" else {"F32", q.upper()})
    assert info.tensors["blk.0.attn_q.weight"].shape == (cfg.n_heads * cfg.hd, cfg.d_model)
    assert all(t.offset % 4096 == 0 for t in info.tensors.values())


def test_layer_ranges_are_contiguous_and_disjoint(files):
  info = gguf_io.read_info(files["q4_0"])
  rs = [info.layer_range(i) for i in range(info.cfg.n_layers)]
  for (a0, b0), (a1, _) in zip(rs, rs[1:]):
    assert b0 <= a1
  for i, (a, b) in enumerate(rs):
    inside = [t for t in info.tensors.values() if a <= t.offset < b]
    assert {gguf_io.layer_of(t.name) for t in inside} == {i}


def test_f32_round_trip_is_exact_and_quantized_is_close(tiny, files):
  cfg, params, _ = tiny
  ref = jax.tree_util.tree_leaves_with_path(jax.tree.map(np.asarray, jax.tree.map(lambda x: x, names._unbox(params))))
  for q, tol in (("f32", 0.0), ("f16", 2e-3), ("q8_0", 0.02), ("q4_0", 0.3)):
    back, cfg2 = gguf_io.load_params(files[q])
    assert cfg2 == cfg
    got = dict(jax.tree_util.tree_leaves_with_path(back))
    for k, v in ref:
      err = np.abs(got[k] - v).max()
      assert err <= tol * max(1.0, np.abs(v).max()), (q, k, err)


def test_truncated_and_corrupt_files_give_clear_errors(files, tmp_path):
  data = open(files["q8_0"], "rb").read()
  bad = tmp_path / "trunc.gguf"
  bad.write_bytes(data[: len(data) - 5000])
  with pytest.raises(gguf_io.GGUFError, match="truncated|corrupt"):
    gguf_io.read_info(str(bad))
  bad.write_bytes(b"GGUX" + data[4:])
  with pytest.raises(gguf_io.GGUFError, match="not a GGUF file"):
    gguf_io.read_info(str(bad))
  bad.write_bytes(data[:100])
  with pytest.raises(gguf_io.GGUFError, match="re-export"):
    gguf_io.read_info(str(bad))
  with pytest.raises(gguf_io.GGUFError, match="no such file"):
    gguf_io.read_info(str(tmp_path / "missing.gguf"))


def _spm_like_llama_cpp(text, tokens, types):
  """What llama.cpp's SPM tokenizer does with our vocab: escape ' ' to U+2581, look each character up,
  fall back to <0xXX> byte tokens. (No merges can apply: no token is a concatenation of two others.)"""
  index = {t: i for i, t in enumerate(tokens)}
  ids = []
  for ch in text.replace(" ", SPACE_PIECE):
    if ch in index and types[index[ch]] == 1:
      ids.append(index[ch])
    else:
      ids.extend(index[f"<0x{b:02X}>"] for b in ch.encode("utf-8"))
  return ids


def test_tokenizer_vocab_reproduces_byte_ids(files):
  info = gguf_io.read_info(files["f32"])
  text = "def f(x):\n\treturn 'héllo' + \"wörld\" ~ 42 €\x01"
  assert _spm_like_llama_cpp(text, info.tokens, info.token_types) == ByteTokenizer().encode(text)
  assert len(set(info.tokens)) == len(info.tokens)
  # No merges possible: no token equals the concatenation of two others.
  toks = set(info.tokens)
  assert not any((a + b) in toks for a in info.tokens[:128] for b in info.tokens[:128])
  from ondevice import vocab
  v = vocab.load(files["f32"])
  assert v.encode(text, add_special=True) == ByteTokenizer().encode(text)  # the general SPM tokenizer agrees
  assert v.decode(ByteTokenizer().encode(text)) == text
  assert ByteTokenizer(300).gguf_vocab()[0][256] == "<extra_0>" and ByteTokenizer(300).eos_id == 256


def test_unknown_quant_is_explained(tiny, tmp_path):
  cfg, params, _ = tiny
  with pytest.raises(gguf_io.GGUFError, match="choose one of"):
    gguf_io.export_gguf(params, cfg, str(tmp_path / "x.gguf"), "q3_k")
  assert not os.path.exists(tmp_path / "x.gguf")
