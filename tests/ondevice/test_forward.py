"""Forward pass on packed GGUF weights: F32 parity with framework.model, KV cache, quantized kernels."""
import gguf
import numpy as np
import pytest

from ondevice import forward, kernels
from ondevice.weights import MappedGGUF

from .conftest import PROMPT


def _model(path, **kw):
  return forward.GGUFLlama(MappedGGUF(path), **kw)


def test_f32_file_logits_match_framework_model(tiny, files):
  _, _, ref = tiny
  m = _model(files["f32"])
  got = m.forward(PROMPT, 0, m.new_cache())
  # 1e-5 relative to the logit scale: these logits reach ~6, where float32 rounding alone (different
  # summation order than XLA) is ~1e-5 absolute; measured 1.35e-5 abs = 2.3e-6 of the scale.
  scale = max(1.0, float(np.abs(ref).max()))
  assert np.abs(got - ref).max() <= 1e-5 * scale, np.abs(got - ref).max()
  assert scale > 1.0  # peaked enough that the check is not trivially small numbers


def test_kv_cache_incremental_equals_full_and_rollback_overwrites(tiny, files):
  _, _, ref = tiny
  m = _model(files["f32"])
  c = m.new_cache()
  parts = [m.forward(PROMPT[:7], 0, c)] + [m.forward([t], i, c) for i, t in enumerate(PROMPT[7:], 7)]
  tol = 1e-5 * max(1.0, float(np.abs(ref).max()))
  assert np.abs(np.concatenate(parts) - ref).max() <= tol
  # Rollback: write garbage at positions 10.., then redo from 10: identical to the clean run.
  m.forward([1, 2, 3, 4], 10, c)
  redo = m.forward(PROMPT[10:], 10, c)
  assert np.abs(redo - ref[10:]).max() <= tol


@pytest.mark.parametrize("q", ["f16", "q4_0", "q8_0"])
def test_quantized_files_match_framework_on_dequantized_weights(files, q):
  """Reference = framework.model run on the file's own (dequantised) weights, so the only differences
  left are float rounding (F16, Q4_0: f32 activations) or Q8_0's activation quantisation (as llama.cpp)."""
  import jax
  from framework import model as fm
  from ondevice import gguf_io
  params, cfg = gguf_io.load_params(files[q])
  with jax.numpy_rank_promotion("allow"):
    ref = np.asarray(fm.build(cfg).apply({"params": params}, jax.numpy.asarray([PROMPT])))[0]
  m = _model(files[q])
  got = m.forward(PROMPT, 0, m.new_cache())
  scale = max(1.0, float(np.abs(ref).max()))
  err = np.abs(got - ref).max()
  if q == "q8_0":
    assert err <= 0.1 * scale and (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8, err
  else:
    assert err <= 1e-5 * scale, err


def _q8_reference(w_OxI, x_TxI):
  """ggml semantics: weight Q8_0 blocks x activation Q8_0 blocks (round half away from zero)."""
  qw = gguf.quants.quantize(w_OxI, gguf.GGMLQuantizationType.Q8_0)
  wd = kernels.dequantize_rows("Q8_0", qw, w_OxI.shape[1])
  xb = x_TxI.reshape(x_TxI.shape[0], -1, 32)
  d = np.abs(xb).max(-1, keepdims=True) / 127
  q = np.sign(xb / d) * np.floor(np.abs(xb / d) + 0.5)
  return qw, (q * d).reshape(x_TxI.shape) @ wd.T


@pytest.mark.parametrize("T", [1, 5])
def test_kernels_match_dequantized_references(T):
  rng = np.random.default_rng(0)
  w = rng.normal(size=(96, 128)).astype(np.float32)
  x = rng.normal(size=(T, 128)).astype(np.float32)
  for qt in ("F16", "Q4_0"):
    raw = w.astype(np.float16) if qt == "F16" else gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    deq = raw.astype(np.float32) if qt == "F16" else gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_allclose(kernels.matmul(qt, raw, x, 96, 128), x @ deq.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(kernels.dequantize_rows(qt, raw[3:5], 128), deq[3:5])
  qw, ref = _q8_reference(w, x)
  np.testing.assert_allclose(kernels.matmul("Q8_0", qw, x, 96, 128), ref, rtol=1e-4, atol=1e-4)


def test_greedy_generation_with_cache_equals_recompute(files):
  m = _model(files["q8_0"])
  out = forward.greedy_generate(m, PROMPT, 8)
  seq = list(PROMPT)
  for _ in range(8):
    seq.append(int(m.forward(seq, 0, m.new_cache())[-1].argmax()))
  assert out == seq[len(PROMPT):]
