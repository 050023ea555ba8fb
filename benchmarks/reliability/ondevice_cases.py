"""The ondevice bad-input cases about GGUF files (registered into ``ondevice_area.CASES``), by class.

gguf_truncated / gguf_header / gguf_index / gguf_data: one of our Q4_0 exports, cut or with one bit
flipped in a chosen part; gguf_unsupported: quant types and llama features the runtime does not compute;
gguf_foreign: files written with the ``gguf`` package's writer the way llama.cpp's converter writes them;
generation / plan: limits and devices files checked before the first token; ring_peer: a ring device
killed or frozen mid-generation; export: a failed export must not destroy the file it would replace.
"""
from __future__ import annotations

import os

import numpy as np

from benchmarks.reliability.harness import NotExercised
from benchmarks.reliability.ondevice_area import Outcome, case, flip, header_offsets, invoke, put, run_cli

RUN = "ondevice.run"


def _run_model(path: str, *extra, ok=None, timeout_s=120.0) -> Outcome:
  argv = ["--model", path, "--prompt", "def f(x):", "--max-tokens", "8", "--greedy", "--no-stop", *extra]
  return run_cli(RUN, argv, ok, timeout_s)


def _corrupt(ws, name: str, mutate) -> Outcome:
  return _run_model(ws.copy_with(name, mutate))


REFERENCE_TIMEOUT_S = 600.0  # a reference run of an intact file: not the case under test, so no tight limit


def _tokens_of(ws, path: str, n: int = 8) -> str:
  """The text our engine generates from ``path`` (reference for the 'recovered' checks)."""
  r = invoke("ondevice.run", ["--model", path, "--prompt", "def f(x):", "--max-tokens", str(n), "--greedy",
                              "--no-stop"], timeout_s=REFERENCE_TIMEOUT_S)
  _reference_ran(r, path)
  return r.out


def _reference_ran(r, path: str) -> None:
  """The reference run of the intact file must succeed for the case to judge its fault: when it does not (its time
  limit on a loaded host), the fault was not exercised; a real failure of intact files shows in the other cases."""
  if r.rc != 0 or r.exc is not None:
    why = type(r.exc).__name__ if r.exc is not None else f"rc {r.rc}"
    raise NotExercised(f"the reference run on {os.path.basename(path)} did not finish ({why}, {r.seconds:.0f} s): "
                       f"{(r.err.strip().splitlines() or [''])[-1][:200]}")


def _same_text_as(ref: str):
  return lambda out, err: out == ref


# ------------------------------------------------------------------------------------------ truncated

def _cut(n_or_frac):
  def mutate(d):
    n = int(len(d) * n_or_frac) if isinstance(n_or_frac, float) else n_or_frac
    return d[:n]
  return mutate


@case("gguf_truncated")
def _empty_file(ws):
  return _corrupt(ws, "t-empty.gguf", _cut(0))


@case("gguf_truncated")
def _cut_in_magic(ws):
  return _corrupt(ws, "t-magic.gguf", _cut(3))


@case("gguf_truncated")
def _cut_in_counts(ws):
  return _corrupt(ws, "t-counts.gguf", _cut(12))


@case("gguf_truncated")
def _cut_in_metadata(ws):
  return _corrupt(ws, "t-meta.gguf", _cut(header_offsets(ws.good)[("kv", "tokenizer.ggml.tokens")][-1] - 3))


@case("gguf_truncated")
def _cut_in_tensor_index(ws):
  return _corrupt(ws, "t-index.gguf", _cut(header_offsets(ws.good)[("tensor", "blk.1.attn_q.weight")][1] + 3))


@case("gguf_truncated")
def _cut_at_data_start(ws):
  return _corrupt(ws, "t-data0.gguf", _cut(header_offsets(ws.good)["data"]))


@case("gguf_truncated")
def _cut_mid_data(ws):
  return _corrupt(ws, "t-half.gguf", _cut(0.5))


@case("gguf_truncated")
def _cut_last_padding_byte(ws):
  """Only alignment padding after the last tensor is lost: the file is still whole, and must run as before."""
  return _run_model(ws.copy_with("t-pad.gguf", lambda d: d[:-1]), ok=_same_text_as(_tokens_of(ws, ws.good)))


@case("gguf_truncated")
def _cut_inside_last_tensor(ws):
  end = max(a + n for a, n in (v for k, v in header_offsets(ws.good).items() if k[0] == "tensor_data"))
  return _corrupt(ws, "t-last.gguf", _cut(end - 1))


# ------------------------------------------------------------------------------------------ header bit flips

def _kv(ws, key, part):
  return header_offsets(ws.good)[("kv", key)][part]


@case("gguf_header")
def _flip_magic(ws):
  return _corrupt(ws, "h-magic.gguf", lambda d: flip(d, 1, 2))


@case("gguf_header")
def _flip_version(ws):
  return _corrupt(ws, "h-version.gguf", lambda d: flip(d, 6, 0))


@case("gguf_header")
def _flip_tensor_count(ws):
  return _corrupt(ws, "h-ntensors.gguf", lambda d: flip(d, 8 + 5, 3))


@case("gguf_header")
def _flip_kv_count(ws):
  return _corrupt(ws, "h-nkv.gguf", lambda d: flip(d, 16 + 7, 6))


@case("gguf_header")
def _flip_key_length(ws):
  return _corrupt(ws, "h-keylen.gguf", lambda d: flip(d, _kv(ws, "llama.block_count", 0) + 6, 1))


@case("gguf_header")
def _flip_value_type(ws):
  return _corrupt(ws, "h-vtype.gguf", lambda d: flip(d, _kv(ws, "llama.block_count", 2) + 1, 4))


@case("gguf_header")
def _flip_architecture_length(ws):
  return _corrupt(ws, "h-archlen.gguf", lambda d: flip(d, _kv(ws, "general.architecture", 3) + 4, 0))


@case("gguf_header")
def _flip_vocab_count(ws):
  return _corrupt(ws, "h-vocab.gguf", lambda d: flip(d, _kv(ws, "tokenizer.ggml.tokens", 4) + 5, 2))


@case("gguf_header")
def _token_not_utf8(ws):
  return _corrupt(ws, "h-utf8.gguf", lambda d: put(d, _kv(ws, "tokenizer.ggml.tokens", 6 + 2 * 65), "B", 0xFF))


@case("gguf_header")
def _config_json_damaged(ws):
  return _corrupt(ws, "h-json.gguf", lambda d: put(d, _kv(ws, "prismllm.model_config", 4), "B", ord("[")))


@case("gguf_header")
def _block_count_changed(ws):
  # llama.block_count is not what our loader reads (it reads prismllm.model_config), so change the JSON:
  def mutate(d):
    off = _kv(ws, "prismllm.model_config", 4)
    n = struct_len = int.from_bytes(d[off - 8:off], "little")
    s = bytes(d[off:off + n]).replace(b'"n_layers": 4', b'"n_layers": 5')
    d[off:off + struct_len] = s
    return d
  return _corrupt(ws, "h-layers.gguf", mutate)


# ------------------------------------------------------------------------------------------ tensor index flips

def _ti(ws, name, part):
  return header_offsets(ws.good)[("tensor", name)][part]


@case("gguf_index")
def _tensor_renamed(ws):
  return _corrupt(ws, "i-name.gguf", lambda d: flip(d, _ti(ws, "blk.2.ffn_up.weight", 1) + 8, 1))


@case("gguf_index")
def _tensor_dims_count(ws):
  return _corrupt(ws, "i-ndims.gguf", lambda d: flip(d, _ti(ws, "blk.0.attn_k.weight", 2), 3))


@case("gguf_index")
def _tensor_dim_value(ws):
  return _corrupt(ws, "i-dim.gguf", lambda d: flip(d, _ti(ws, "blk.0.attn_k.weight", 3) + 8, 0))


@case("gguf_index")
def _tensor_type_unknown(ws):
  return _corrupt(ws, "i-type.gguf", lambda d: put(d, _ti(ws, "blk.1.ffn_gate.weight", 4), "I", 200))


@case("gguf_index")
def _tensor_type_other_quant(ws):
  return _corrupt(ws, "i-q5.gguf", lambda d: put(d, _ti(ws, "blk.1.ffn_gate.weight", 4), "I", 6))  # Q5_0


@case("gguf_index")
def _tensor_offset_beyond_file(ws):
  return _corrupt(ws, "i-off.gguf", lambda d: flip(d, _ti(ws, "blk.3.ffn_down.weight", 5) + 4, 0))


@case("gguf_index")
def _tensor_offset_misaligned(ws):
  def mutate(d):
    off = _ti(ws, "blk.1.attn_v.weight", 5)
    return put(d, off, "Q", int.from_bytes(d[off:off + 8], "little") + 32)
  return _corrupt(ws, "i-align.gguf", mutate)


@case("gguf_index")
def _tensors_overlap(ws):
  def mutate(d):
    a, b = _ti(ws, "blk.1.attn_v.weight", 5), _ti(ws, "blk.1.attn_k.weight", 5)
    return put(d, a, "Q", int.from_bytes(d[b:b + 8], "little"))
  return _corrupt(ws, "i-overlap.gguf", mutate)


# ------------------------------------------------------------------------------------------ data flips

def _data(ws, name, src=None):
  """(offset, nbytes) of a tensor's data."""
  return header_offsets(src or ws.good)[("tensor_data", name)]


@case("gguf_data")
def _flip_weight_nibble(ws):
  return _corrupt(ws, "d-nibble.gguf", lambda d: flip(d, _data(ws, "blk.1.ffn_up.weight")[0] + 5, 2))


@case("gguf_data")
def _flip_scale_exponent(ws):
  return _corrupt(ws, "d-scale.gguf", lambda d: flip(d, _data(ws, "blk.0.attn_q.weight")[0] + 18 * 3 + 1, 6))


@case("gguf_data")
def _flip_norm_weight(ws):
  return _corrupt(ws, "d-norm.gguf", lambda d: flip(d, _data(ws, "blk.2.ffn_norm.weight")[0] + 4 * 7 + 2, 7))


@case("gguf_data")
def _nan_scale_without_crc(ws):
  """A file from another writer carries no CRCs: an f16 scale turned NaN is still caught (non-finite check)."""
  src = _foreign(ws, "foreign-q4_0.gguf", "q4_0")
  off = _data(ws, "blk.0.ffn_down.weight", src)[0] + 18 * 2
  return _run_model(ws.copy_with("d-nan.gguf", lambda d: put(d, off, "H", 0x7E00), src))


@case("gguf_data", undetectable=True)
def _flip_nibble_without_crc(ws):
  """Undetectable damage: one nibble of a file without CRCs. The run completes; whether the text changes
  is reported ('silent' if it does, 'recovered' if the flip happened not to change the greedy tokens)."""
  src = _foreign(ws, "foreign-q4_0.gguf", "q4_0")
  ref = _ids(src, [1, 32] + list(b"def f(x):"))  # the text prompt as llama.cpp tokenizes it (_foreign_ok)
  off = _data(ws, "blk.1.ffn_gate.weight", src)[0] + 7
  return _run_model(ws.copy_with("d-silent.gguf", lambda d: flip(d, off, 3), src),
                    ok=lambda out, err: _ids_summary(err) == ref)


# ------------------------------------------------------------------------------------------ unsupported

def _with_types(ws, name: str, qtype: str) -> str:
  """The tiny model with every matrix stored as ``qtype`` (K-quants need rows of 256: a wider model)."""
  if qtype.endswith("_K"):
    from ondevice.gguf_io import random_arrays  # noqa: PLC0415
    cfg = ws.cfg.__class__(**{**ws.cfg.__dict__, "d_model": 256, "d_ff": 256})
    return _foreign(ws, name, qtype.lower(), cfg=cfg, arrays=random_arrays(cfg))
  return _foreign(ws, name, qtype.lower())


@case("gguf_unsupported")
def _q4_1_file(ws):
  return _run_model(_with_types(ws, "u-q4_1.gguf", "Q4_1"))


@case("gguf_unsupported")
def _q5_0_file(ws):
  return _run_model(_with_types(ws, "u-q5_0.gguf", "Q5_0"))


@case("gguf_unsupported")
def _iq4_nl_file(ws):
  return _run_model(_with_types(ws, "u-iq4_nl.gguf", "IQ4_NL"))


@case("gguf_unsupported")
def _q3_k_file(ws):
  return _run_model(_with_types(ws, "u-q3_k.gguf", "Q3_K"))


@case("gguf_unsupported")
def _rope_scaling(ws):
  return _run_model(_foreign(ws, "u-ropescale.gguf", "f32", extra={"llama.rope.scaling.type": "linear"}))


@case("gguf_unsupported")
def _partial_rope(ws):
  return _run_model(_foreign(ws, "u-ropedim.gguf", "f32", extra={"llama.rope.dimension_count": 8}))


@case("gguf_unsupported")
def _mixture_of_experts(ws):
  return _run_model(_foreign(ws, "u-moe.gguf", "f32", extra={"llama.expert_count": 8}))


@case("gguf_unsupported")
def _other_architecture(ws):
  return _run_model(_foreign(ws, "u-arch.gguf", "f32", arch="qwen2"))


# ------------------------------------------------------------------------------------------ foreign writer

def _foreign(ws, name: str, quant: str, arch: str = "llama", extra: dict = None, tied: bool = False,
             tokenizer: str = "llama", llama_keys: bool = True, align: int = None, cfg=None, arrays=None) -> str:
  """The tiny model written the way llama.cpp's convert_hf_to_gguf.py writes a llama: the gguf package's
  GGUFWriter, default 32-byte alignment, llama.* hyperparameters only (no prismllm.* keys), BOS added,
  an SPM vocabulary with scores. Same tensors as ws.good's source arrays."""
  import gguf
  from ondevice.tokenizer import ByteTokenizer
  p = ws.path(name)
  if os.path.exists(p):
    return p
  cfg = cfg or ws.cfg
  arrays = arrays or ws.arrays
  w = gguf.GGUFWriter(p, arch)
  if align:
    w.data_alignment = align
    w.add_custom_alignment(align)
  w.add_name("foreign")
  if llama_keys:
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.hd)
  w.add_file_type({"f32": 0, "q8_0": 7, "q4_0": 2, "bf16": 32}.get(quant, 0))
  tokens, _, types = ByteTokenizer(cfg.vocab_size).gguf_vocab()
  if tokenizer == "llama":
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(types)
  else:
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t.replace("\u2581", "\u0120") for t in tokens])
    w.add_token_types(types)
    w.add_token_merges([])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_add_bos_token(True)
  for k, v in (extra or {}).items():
    if isinstance(v, str):
      w.add_string(k, v)
    else:
      w.add_uint32(k, v)
  for n, a in arrays.items():
    if tied and n == "output.weight":
      continue
    if a.ndim == 1 or quant == "f32":
      w.add_tensor(n, a)
    else:
      gq = getattr(gguf.GGMLQuantizationType, quant.upper())
      try:
        q = gguf.quants.quantize(a, gq)
      except NotImplementedError:  # no numpy quantiser for this type: random bytes of the right size
        blk, nb = gguf.constants.GGML_QUANT_SIZES[gq]
        q = np.random.default_rng(0).integers(0, 255, (a.shape[0], a.shape[1] // blk * nb), np.uint8)
      w.add_tensor(n, q, raw_dtype=gq)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return p


def _foreign_ok(ws, name, quant, ref=None, **kw):
  """Loads, tokenises the text prompt as llama.cpp would (BOS first: the file says add_bos_token; a space prefix:
  SPM's default when the file does not say) and generates exactly the token ids that our own export of the same
  tensors generates from [BOS, space] + the prompt's bytes."""
  p = _foreign(ws, name, quant, **kw)
  want = _ids(ref or (ws.good if quant == "q4_0" else _ours(ws, quant)), [1, 32] + list(b"def f(x):"))
  return _run_model(p, ok=lambda out, err: _ids_summary(err) == want)


def _ids(path, prompt_ids, n=8):
  r = invoke("ondevice.run", ["--model", path, "--prompt-ids", ",".join(map(str, prompt_ids)),
                              "--max-tokens", str(n), "--no-stop"], timeout_s=REFERENCE_TIMEOUT_S)
  _reference_ran(r, path)
  return _ids_summary(r.err)


def _ours(ws, quant):
  from ondevice.gguf_io import write_arrays
  p = ws.path(f"ours-{quant}.gguf")
  if not os.path.exists(p):
    write_arrays(ws.arrays, ws.cfg, p, quant)
  return p


@case("gguf_foreign")
def _llama_cpp_style_f32(ws):
  return _foreign_ok(ws, "foreign-f32.gguf", "f32")


@case("gguf_foreign")
def _llama_cpp_style_q4_0(ws):
  return _foreign_ok(ws, "foreign-q4_0.gguf", "q4_0")


@case("gguf_foreign")
def _llama_cpp_style_q8_0_page_aligned(ws):
  return _foreign_ok(ws, "foreign-q8_0.gguf", "q8_0", align=4096)


@case("gguf_foreign")
def _llama_cpp_style_bf16(ws):
  return _foreign_ok(ws, "foreign-bf16.gguf", "bf16")


@case("gguf_foreign")
def _tied_embeddings(ws):
  """No output.weight: llama.cpp reuses token_embd. Ours must too (reference: our file with output = embd)."""
  from ondevice.gguf_io import write_arrays
  ref_arrays = dict(ws.arrays, **{"output.weight": ws.arrays["token_embd.weight"]})
  ref = ws.path("ours-tied-ref.gguf")
  write_arrays(ref_arrays, ws.cfg, ref, "f32")
  return _foreign_ok(ws, "foreign-tied.gguf", "f32", ref=ref, tied=True)


@case("gguf_foreign")
def _bpe_vocab_text_prompt(ws):
  """A gpt2 (byte-level BPE) vocabulary without merges or pre-tokenizer type: llama.cpp's 'default' pre-tokenizer
  and byte-level characters give [BOS] + the prompt's bytes here; the same ids as our file generates from."""
  ref = _ids(_ours(ws, "f32"), [1] + list(b"def f(x):"))
  return _run_model(_foreign(ws, "foreign-bpe.gguf", "f32", tokenizer="gpt2"),
                    ok=lambda out, err: _ids_summary(err) == ref)


@case("gguf_foreign")
def _bpe_vocab_prompt_ids(ws):
  p = _foreign(ws, "foreign-bpe.gguf", "f32", tokenizer="gpt2")
  ref = _ids(_ours(ws, "f32"), [100, 101, 102], 6)
  return run_cli(RUN, ["--model", p, "--prompt-ids", "100,101,102", "--max-tokens", "6", "--no-stop"],
                 ok=lambda out, err: _ids_summary(err) == ref)


def _ids_summary(err: str):
  import json
  try:
    return json.loads(err.strip().splitlines()[-1]).get("token_ids")
  except (ValueError, IndexError):
    return None


@case("gguf_foreign")
def _no_llama_hyperparameters(ws):
  return _run_model(_foreign(ws, "foreign-nokeys.gguf", "f32", llama_keys=False))
