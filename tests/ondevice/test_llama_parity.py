"""Our engine vs llama.cpp (llama-cpp-python, built natively) on the same GGUF: the same logits bit for bit and
the same greedy token stream, at 1 and 2 threads on both sides.

The model is random with init std 0.02, so its logits are nearly flat (top-2 margins ~0.01): a difference in
the last bit of one activation flips a Q8_0 rounding and, within a few dozen tokens, the argmax. Equal
streams therefore need equal arithmetic (planes_kernels.py lists what llama.cpp does); before it matched,
the streams of the 16-layer model diverged after 21 tokens, and our mmap-layout kernels (float sums, used
only with --real-io) still differ from llama.cpp here (``test_control``). llama.cpp runs in its exact-arithmetic
configuration: f32 KV cache and flash attention off (its CPU flash-attention path rounds Q and the V
accumulator to f16, which no f32 engine reproduces; README, llama.cpp parity).
"""
import numpy as np
import pytest

from ondevice import planes
from ondevice.gguf_io import random_arrays, tiny_config, write_arrays

from .conftest import llama_cpp_peer
PROMPT = list(b"import os\nimport sys\n\n\ndef main(argv):\n    ")
N = 64


@pytest.fixture(scope="module")
def flat_models(tmp_path_factory):
  d = tmp_path_factory.mktemp("parity")
  cfg = tiny_config(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768, max_seq_len=128, init_std=0.02)
  arrays = random_arrays(cfg, seed=5, std=0.02)
  out = {}
  for q in ("q4_0", "q8_0"):
    out[q] = str(d / f"flat-{q}.gguf")
    write_arrays(arrays, cfg, out[q], q)
  return out


def _llama(path, threads):
  return llama_cpp_peer().Llama(path, n_ctx=128, n_threads=threads, n_threads_batch=threads, type_k=0, type_v=0,
                         flash_attn=False, logits_all=True, verbose=False)


@pytest.mark.parametrize("q", ["q4_0", "q8_0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_same_logits_and_greedy_stream_as_llama_cpp(flat_models, q, threads):
  from ondevice.forward import GGUFLlama
  from ondevice.weights import MappedGGUF
  llm = _llama(flat_models[q], threads)
  planes.set_threads(threads)
  try:
    m = GGUFLlama(MappedGGUF(flat_models[q]), max_len=128)
    c = m.new_cache()
    ours = m.forward(PROMPT, 0, c)
    llm.eval(PROMPT)
    theirs = llm.scores[:len(PROMPT)]
    np.testing.assert_array_equal(ours, theirs, err_msg="prefill logits")
    a, b, toks, margins = ours[-1], theirs[-1], [], []
    for i in range(N):
      ta, tb = int(np.argmax(a)), int(np.argmax(b))
      assert ta == tb, f"greedy streams diverge at token {i} ({toks})"
      np.testing.assert_array_equal(a, b, err_msg=f"logits at token {i}")
      top = np.sort(b)[-2:]
      margins.append(float(top[1] - top[0]))
      toks.append(ta)
      a = m.forward([ta], len(PROMPT) + i, c)[-1]
      llm.eval([ta])
      b = llm.scores[llm.n_tokens - 1]
    # the test is only meaningful if the stream passes near-ties, where a last-bit difference would flip it
    assert min(margins) < 0.02, min(margins)
  finally:
    planes.set_threads(1)


def test_bench_reports_the_same_stream(flat_models):
  """ondevice.bench's single suite times both engines on one token stream and says whether it is the greedy
  stream of both (it must be, in the exact configuration)."""
  llama_cpp_peer()
  from ondevice import bench_single
  res = bench_single.run(flat_models["q4_0"], PROMPT, 12, threads=(1,), rounds=1)
  r = res["threads_1"]
  build = res["llama_cpp_build"]  # the baseline's build is part of the record
  assert build["version"] and ("AVX2 = 1" in build["system_info"] or "NEON = 1" in build["system_info"])
  assert r["same_greedy_tokens_exact_config"] is True
  assert r["ours"]["tpot_ms"] > 0 and r["llama_cpp_exact"]["tpot_ms"] > 0


def test_control_float_kernels_differ(flat_models):
  """The comparison is sensitive: our mmap-layout path (kernels.py: float block sums, numpy attention) gives
  prefill logits that differ from llama.cpp's (measured 0.0096 at a logit scale of ~0.1; its greedy stream
  leaves llama.cpp's after 45 tokens), so equality above is not automatic."""
  from ondevice.forward import GGUFLlama
  from ondevice.weights import MappedGGUF
  llm = _llama(flat_models["q4_0"], 1)
  m = GGUFLlama(MappedGGUF(flat_models["q4_0"]), max_len=128, repack=False)
  ours = m.forward(PROMPT, 0, m.new_cache())
  llm.eval(PROMPT)
  assert np.abs(ours - llm.scores[:len(PROMPT)]).max() > 1e-4
