"""Forward pass on packed GGUF weights: F32 parity with framework.model, KV cache, quantized kernels."""
import gguf
import numpy as np
import pytest

from ondevice import forward, kernels, planes
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
  left are the activations' rounding to f16 (F16) or, for Q8_0/Q4_0, their quantisation to Q8_0 that llama.cpp
  also does (the exact ggml semantics are checked kernel by kernel below and against llama.cpp itself)."""
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
  if q in ("q8_0", "q4_0"):
    assert err <= 0.1 * scale and (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8, err
  else:  # F16 dots read activations rounded to f16, as ggml's do (measured 1.9e-3 of the scale)
    assert err <= 5e-3 * scale and (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9, err


def _ggml_reference(qt, w_OxI, x_TxI):
  """ggml's x86 CPU dot, written independently in integers: activations -> Q8_0 blocks (q = round half
  to even of x * 127/amax, scale amax/127 stored as f16: quantize_row_q8_0's AVX path), per block the
  int32 sum of q_w * q_x (Q4_0: q_w = nibble - 8), times d_w * d_x."""
  g = getattr(gguf.GGMLQuantizationType, qt)
  raw = gguf.quants.quantize(w_OxI, g)
  O, I = w_OxI.shape
  blk = raw.reshape(O, I // 32, -1)
  dw_OxB = blk[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
  if qt == "Q8_0":
    qw_OxBxJ = blk[..., 2:].view(np.int8).astype(np.int64)
  else:
    qw_OxBxJ = np.concatenate([blk[..., 2:] & 15, blk[..., 2:] >> 4], -1).astype(np.int64) - 8
  xb = x_TxI.reshape(x_TxI.shape[0], -1, 32)
  amax = np.abs(xb).max(-1)
  qx_TxBxJ = np.rint(xb * (np.float32(127) / amax)[..., None]).astype(np.int64)
  dx_TxB = (amax / np.float32(127)).astype(np.float16).astype(np.float64)
  isum_TxOxB = np.einsum("tbj,obj->tob", qx_TxBxJ, qw_OxBxJ)
  return raw, (isum_TxOxB * dw_OxB[None] * dx_TxB[:, None]).sum(-1)


@pytest.mark.parametrize("T", [1, 5])
def test_kernels_match_dequantized_references(T):
  rng = np.random.default_rng(0)
  w = rng.normal(size=(96, 128)).astype(np.float32)
  x = rng.normal(size=(T, 128)).astype(np.float32)
  raw = w.astype(np.float16)
  np.testing.assert_allclose(kernels.matmul("F16", raw, x, 96, 128), x @ raw.astype(np.float32).T, rtol=1e-4,
                             atol=1e-4)
  for qt in ("Q4_0", "Q8_0"):
    qw, ref = _ggml_reference(qt, w, x)
    deq = gguf.quants.dequantize(qw, getattr(gguf.GGMLQuantizationType, qt))
    np.testing.assert_array_equal(kernels.dequantize_rows(qt, qw[3:5], 128), deq[3:5])
    tol = 2e-6 * np.abs(ref).max()  # float32 rounding of a 128-term sum; a wrong block or scale is O(1)
    assert np.abs(kernels.matmul(qt, qw, x, 96, 128) - ref).max() <= tol, qt
    # planes: 96 rows = one full group of 64 + a padded one; packed together with a second matrix
    qw2, ref2 = _ggml_reference(qt, w[:40] * 3, x)
    got, got2 = planes.repack(qt, [qw, qw2], 128)(x, batched=T >= 2)
    assert got.shape == (T, 96) and got2.shape == (T, 40)
    assert np.abs(got - ref).max() <= tol and np.abs(got2 - ref2).max() <= 3 * tol, qt


@pytest.mark.parametrize("qt", ["Q4_0", "Q8_0"])
def test_planes_rows_do_not_depend_on_how_many_tokens_share_a_call(qt):
  """Speculative decoding verifies gamma+1 tokens in one call and must reproduce greedy decoding's
  one-token calls bit for bit; the kernels take tokens 4 at a time, then singly."""
  rng = np.random.default_rng(1)
  w = rng.normal(size=(80, 96)).astype(np.float32)
  p = planes.repack(qt, [gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qt))], 96)
  x = rng.normal(size=(9, 96)).astype(np.float32)
  together = p(x)[0]
  for t in range(9):
    np.testing.assert_array_equal(p(x[t:t + 1])[0][0], together[t])


def test_planes_kernels_vectorise():
  """The planes kernels are only fast with SIMD code: AVX-512 VNNI dot products where the CPU has them."""
  from ondevice import simd
  for qt in ("Q4_0", "Q8_0"):
    asm = planes.inspect_asm(qt)
    if simd.has_vnni():
      assert "vpdpbusd" in asm and "zmm" in asm, f"no VNNI in the {qt} planes kernel: check numba/LLVM"
    else:
      assert "ymm" in asm or "xmm" in asm, f"no vector registers in the {qt} planes kernel"


@pytest.mark.parametrize("q", ["q4_0", "q8_0"])
def test_kernel_threads_give_the_same_bits(files, q):
  """2 kernel threads (planes.Team: split row groups and KV heads, spinning barriers) = 1 thread, bit for bit,
  for a prefill and decode steps; and a team survives many calls (no lost wake-ups)."""
  m = _model(files[q])

  def run():
    c = m.new_cache()
    out = [m.forward(PROMPT[:9], 0, c)]
    out += [m.forward([t], i, c) for i, t in enumerate(PROMPT[9:], 9)]
    return np.concatenate(out)
  try:
    planes.set_threads(1)
    one = run()
    planes.set_threads(2)
    for _ in range(3):
      np.testing.assert_array_equal(run(), one)
  finally:
    planes.set_threads(1)


@pytest.mark.parametrize("q", ["q4_0", "q8_0"])
def test_fused_planes_layer_equals_unfused_mmap_path(files, q):
  """planes.layers (one numba call per step, repacked weights, numba attention) vs the numpy layer on
  the mmap kernels: same ggml semantics, so only float32 summation order differs; prefill then decode."""
  fused, plain = _model(files[q]), _model(files[q], repack=False)
  assert fused.pack is not None and plain.pack is None

  def run(m):
    c = m.new_cache()
    prefill = m.forward(PROMPT[:9], 0, c)
    return np.concatenate([prefill] + [m.forward([t], i, c) for i, t in enumerate(PROMPT[9:], 9)])

  a, b = run(fused), run(plain)
  # measured 7e-7 of 5.8; a wrong head, position or block is O(scale). Both paths share ggml's rms_norm:
  # with numpy's, a last-bit difference flipped exact .5 ties of the quantised embedding (0.24 off).
  assert np.abs(a - b).max() <= 1e-5 * max(1.0, float(np.abs(b).max())), np.abs(a - b).max()
  assert (a.argmax(-1) == b.argmax(-1)).all()


def test_greedy_generation_with_cache_equals_recompute(files):
  m = _model(files["q8_0"])
  out = forward.greedy_generate(m, PROMPT, 8)
  seq = list(PROMPT)
  for _ in range(8):
    seq.append(int(m.forward(seq, 0, m.new_cache())[-1].argmax()))
  assert out == seq[len(PROMPT):]


@pytest.mark.parametrize("qt", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_vector_kernels_equal_their_loop_statement(qt):
  """simd_k's vector kernels (what runs) = matvec's plain loops (the arithmetic written out), for every mode
  (Q4_K gemv / gemm, Q5_K / Q6_K vec_dot / tiled), on random K-quant blocks with finite scales. The plain loops
  in turn equal llama.cpp (test_hub.py)."""
  import numba
  from ondevice import kquants, matvec, simd_k
  rng = np.random.default_rng(3)
  n_out, n_in = 80, 512
  nb = n_in // 256
  raw = rng.integers(0, 256, (n_out, nb, kquants.BLOCK_BYTES[qt]), np.uint8)
  half = rng.uniform(1e-4, 1e-2, (n_out, nb, 2)).astype(np.float16).view(np.uint8)
  if qt == "Q6_K":
    raw[..., 208:210] = half[..., :2]
  else:
    raw[..., 0:4] = half
  q, s = kquants.repack(qt, raw.reshape(n_out, -1), n_in)
  W, S, G = q.ravel(), s.ravel(), q.shape[0]
  x = rng.normal(size=(1, n_in)).astype(np.float32)
  kq, kd, kbs = np.empty((1, n_in), np.int8), np.empty((1, nb), np.float32), np.empty((1, n_in // 16), np.int32)
  matvec.act_q8k(x, kq, kd, kbs)
  names = {"Q4_K": ("q4k_gemv", "q4k_gemm"), "Q5_K": ("q5k_vec", "q5k_tiled"), "Q6_K": ("q6k_vec", "q6k_tiled")}[qt]
  for mode, name in enumerate(names):
    f = getattr(simd_k, name)
    run = numba.njit(lambda W, qo, S, so, nb, x32, kd, kbs, out, oo: f(W, qo, S, so, nb, x32, 0, kd, kbs, out, oo))
    a, b = np.zeros(64 * G, np.float32), np.zeros(64 * G, np.float32)
    for g in range(G):
      qo = g * nb * kquants.QUANT_BYTES[qt]
      so = g * nb * kquants.SCALE_BYTES[qt]
      if qt == "Q4_K":
        matvec.q4k_rows(W, qo, S, so, nb, kq[0], kd[0], kbs[0], bool(mode), a, 64 * g)
      else:
        matvec.q56k_rows(W, qo, S, so, nb, kq[0], kd[0], kbs[0], qt == "Q6_K", bool(mode), a, 64 * g)
      run(W, qo, S, so, nb, kq[0].view(np.int32), kd[0], kbs[0], b, 64 * g)
    np.testing.assert_array_equal(a, b, err_msg=name)
    assert np.isfinite(a).all() and np.abs(a[:n_out]).max() > 0
