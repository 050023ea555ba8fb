"""Mixture-of-experts GGUFs (ondevice/moe.py): llama.cpp's MoE tensor layout, the same logits and greedy tokens as
llama.cpp on random Qwen3-MoE- and Mixtral-shaped files, and only the routed experts' pages read per token."""
import os
import subprocess

import numpy as np
import pytest

from ondevice import gguf_check, gguf_io, testmodels
from ondevice.weights import PAGE, MappedGGUF

from .conftest import llama_cpp_peer

PROMPT = list(b"import os\nimport sys\n\ndef main(argv):\n  ")
N = 24
PARITY = [(k, q) for k in ("qwen3moe", "mixtral") for q in ("f16", "q8_0", "q4_0")]


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
  d = tmp_path_factory.mktemp("moe")
  out = {}
  for kind, q in PARITY:
    out[kind, q] = str(d / f"{kind}-{q}.gguf")
    testmodels.moe_gguf(out[kind, q], kind, q, n_layers=2, d_model=128, n_expert=8, n_used=2, ff=128, seed=3)
  return out


def test_llama_cpp_moe_layout(moe_files):
  """Tensor names, GGUF dims and metadata as llama.cpp's loader reads them (ne order = reversed numpy shape)."""
  from gguf import GGUFReader
  for kind, arch in (("qwen3moe", "qwen3moe"), ("mixtral", "llama")):
    r = GGUFReader(moe_files[kind, "q8_0"])
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == arch
    f = {k: int(r.fields[k].parts[-1][0]) for k in r.fields if ".expert" in k}
    want = {f"{arch}.expert_count": 8, f"{arch}.expert_used_count": 2}
    if arch == "qwen3moe":
      want[f"{arch}.expert_feed_forward_length"] = 128
    assert f == want
    t = {x.name: x for x in r.tensors}
    assert [int(v) for v in t["blk.1.ffn_gate_inp.weight"].shape] == [128, 8]  # {n_embd, n_expert}
    assert t["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"
    for n in ("gate", "up"):
      assert [int(v) for v in t[f"blk.1.ffn_{n}_exps.weight"].shape] == [128, 128, 8]  # {n_embd, n_ff, n_expert}
    assert [int(v) for v in t["blk.1.ffn_down_exps.weight"].shape] == [128, 128, 8]
    assert t["blk.1.ffn_down_exps.weight"].tensor_type.name == "Q8_0"
    assert "blk.0.ffn_up.weight" not in t and ("blk.0.attn_q_norm.weight" in t) == (arch == "qwen3moe")
    info = gguf_io.read_info(moe_files[kind, "q8_0"])
    assert info.moe == gguf_check.MoE(8, 2, 128) and info.rope_neox == (arch == "qwen3moe")


@pytest.mark.parametrize("kind,q", PARITY)
def test_same_logits_and_greedy_stream_as_llama_cpp(moe_files, kind, q):
  from ondevice.forward import GGUFLlama
  llm = llama_cpp_peer().Llama(moe_files[kind, q], n_ctx=128, n_threads=1, n_threads_batch=1, type_k=0, type_v=0,
                               flash_attn=False, logits_all=True, verbose=False)
  m = GGUFLlama(MappedGGUF(moe_files[kind, q]), max_len=128)
  c = m.new_cache()
  ours = m.forward(PROMPT, 0, c)
  llm.eval(PROMPT)
  np.testing.assert_array_equal(ours, llm.scores[:len(PROMPT)], err_msg="prefill logits")
  a, b, toks = ours[-1], llm.scores[len(PROMPT) - 1], []
  for i in range(N):
    ta, tb = int(np.argmax(a)), int(np.argmax(b))
    assert ta == tb, f"greedy streams diverge at token {i} ({toks})"
    np.testing.assert_array_equal(a, b, err_msg=f"logits at token {i}")
    toks.append(ta)
    a = m.forward([ta], len(PROMPT) + i, c)[-1]
    llm.eval([ta])
    b = llm.scores[llm.n_tokens - 1]
  assert len(set(toks)) > 3  # a stream, not one repeated token
  used = m.experts.counts
  assert (used > 0).sum(axis=1).min() > 2  # tokens were routed to different experts
  if q != "f16":  # the quantised experts ran in the file's layout (moe_kernels.file_matmul), none repacked
    assert m.experts.repacks == 0 and m.experts.in_place_uses > 0


@pytest.mark.parametrize("qt", ["Q8_0", "Q4_0"])
def test_file_layout_kernel_equals_planes_kernel(qt):
  """The in-place Q8_0 / Q4_0 kernel on the file's blocks gives the repacked planes kernel's bits (which are
  llama.cpp's), for one and several tokens, and is near the float product (it sees the weights)."""
  import gguf
  from ondevice import moe, moe_kernels
  if not moe_kernels.HAVE_NUMBA:
    pytest.skip("numba is not installed")
  rng = np.random.default_rng(7)
  for n_out, n_in in ((64, 256), (200, 96), (8 * moe_kernels.FILE_ROWS[qt], 32)):
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qt]).view(np.uint8).reshape(-1)
    deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qt]).reshape(n_out, n_in)
    buf = np.zeros(4096 + raw.nbytes, np.uint8)
    buf[4096:] = raw
    for T in (1, 3):
      x = (rng.standard_normal((T, n_in)) * 2).astype(np.float32)
      ours = moe._FileQ0(qt, buf, 4096, n_out, n_in)(x)
      np.testing.assert_array_equal(ours, moe._Repacked(qt, raw, n_out, n_in)(x), err_msg=f"{qt} {n_out}x{n_in} T={T}")
      ref = x @ deq.T
      assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()


def test_hot_experts_repacked_same_logits(moe_files):
  """An expert used more than ``repack_after`` times is repacked into the cache; the logits do not change."""
  from ondevice.forward import GGUFLlama
  path = moe_files["qwen3moe", "q8_0"]
  logits = {}
  for name, cache_mb, after in (("in_place", 0, 64), ("repacked", None, 1)):
    m = GGUFLlama(MappedGGUF(path), max_len=64, expert_cache_mb=cache_mb)
    m.experts.repack_after = after
    c = m.new_cache()
    out = [m.forward(PROMPT[:8], 0, c)[-1]]
    for i in range(6):
      out.append(m.forward([int(np.argmax(out[-1]))], 8 + i, c)[-1])
    logits[name] = np.array(out)
    st = m.experts.stats()
    assert (st["repacks"] == 0) if name == "in_place" else (st["repacks"] > 0 and st["expert_cache_held_mb"] > 0)
    assert st["in_place_uses"] > 0
  np.testing.assert_array_equal(logits["in_place"], logits["repacked"])


def test_control_routing_matters(moe_files):
  """The comparison sees the routing: renormalising nothing (plain top-k probabilities) moves the logits."""
  from ondevice.forward import GGUFLlama
  m = GGUFLlama(MappedGGUF(moe_files["qwen3moe", "q8_0"]), max_len=64)
  ref = m.forward(PROMPT, 0, m.new_cache())
  route = m.experts.route
  m.experts.route = lambda i, h, b: (lambda s, w: (s, w * np.float32(0.5)))(*route(i, h, b))
  assert np.abs(m.forward(PROMPT, 0, m.new_cache()) - ref).max() > 1e-3


def _disk_dir(tmp_path):
  out = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True, timeout=10)
  if out.stdout.strip() in ("tmpfs", "ramfs", "overlay"):
    pytest.skip(f"{out.stdout.strip()} cannot evict pages: page residency not observable")
  return str(tmp_path)


@pytest.mark.parametrize("q", ["q8_0", "f16"])
def test_decode_reads_only_routed_experts(tmp_path, q):
  """A cold decode step touches exactly the routed experts' pages (mincore), fewer than all experts' bytes.
  Expert sizes here are whole pages (256 x 256: Q8_0 17 pages, F16 32), so residency is per expert."""
  from ondevice.forward import GGUFLlama
  path = os.path.join(_disk_dir(tmp_path), f"pages-{q}.gguf")
  testmodels.moe_gguf(path, "qwen3moe", q, n_layers=2, d_model=256, n_expert=8, n_used=2, ff=256, seed=1)
  fd = os.open(path, os.O_RDONLY)
  os.fsync(fd)
  os.close(fd)
  mapped = MappedGGUF(path)
  m = GGUFLlama(mapped, max_len=64, expert_cache_mb=0)
  c = m.new_cache()
  tok = int(np.argmax(m.forward(PROMPT, 0, c, last_only=True)[-1]))
  ex = m.experts
  ex.evict()
  mapped.release(0, mapped.info.file_size)
  before, mapped0 = ex.counts.copy(), ex.mapped_bytes
  m.forward([tok], len(PROMPT), c)
  routed = ex.counts - before
  total = touched = 0
  for i in range(2):
    assert routed[i].sum() == 2
    for kind in gguf_check.EXPERT_MATS:
      for e in range(8):
        a, b = ex.expert_range(i, kind, e)
        assert a % PAGE == 0 and b % PAGE == 0
        res = mapped.resident_bytes(a, b)
        assert res == (b - a if routed[i, e] else 0), (i, kind, e, res)
        touched += res
      total += mapped.info.tensors[f"blk.{i}.{kind}.weight"].nbytes
  assert touched == total * 2 // 8 < total
  assert ex.mapped_bytes - mapped0 == touched


def test_bad_moe_metadata_is_one_line(tmp_path):
  cfg = gguf_io.tiny_config(d_model=64, n_layers=1, d_ff=64)
  moe = gguf_check.MoE(4, 2, 64)
  arrays = gguf_io.random_arrays(cfg, arch="qwen3moe", moe=moe)
  path = str(tmp_path / "bad.gguf")
  gguf_io.write_arrays(arrays, cfg, path, "q8_0", arch="qwen3moe", moe=gguf_check.MoE(4, 5, 64))
  with pytest.raises(gguf_check.GGUFError, match="expert_used_count=5") as e:
    gguf_io.read_info(path)
  assert "\n" not in str(e.value)
  ok = str(tmp_path / "ok.gguf")
  gguf_io.write_arrays(arrays, cfg, ok, "q8_0", arch="qwen3moe", moe=moe)
  with pytest.raises(gguf_check.GGUFError, match="mixture-of-experts"):
    gguf_io.load_params(ok)
  info = gguf_io.read_info(ok)  # one flipped byte inside expert 3 of a stacked tensor: refused when it is read
  t = info.tensors["blk.0.ffn_up_exps.weight"]
  with open(ok, "r+b") as f:
    f.seek(t.offset + 3 * t.nbytes // 4 + 5)
    b = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([b[0] ^ 0x10]))
  from ondevice.moe import Experts
  ex = Experts(MappedGGUF(ok), [0])
  ex.matrix(0, "ffn_up_exps", 2)
  with pytest.raises(gguf_check.GGUFError, match="expert 3 of blk.0.ffn_up_exps.weight fails its CRC32"):
    ex.matrix(0, "ffn_up_exps", 3)
