"""Mat-muls on GGUF weights as they lie in the file (F32, F16, Q8_0, Q4_0), no f32 copies.

Quantised dots follow llama.cpp's CPU backend: the activations are first quantised to Q8_0 blocks
(``planes.act_q8``) for Q8_0 AND Q4_0 weights, so the per-block dot is ggml's up to float32 rounding.

These kernels read ggml's row-major 18/34-byte blocks in place in the mmap, so the file's pages are
what they touch (ring devices with real I/O). The fast path is ``ondevice/planes.py``: the same
numbers repacked once at load into SIMD-friendly planes (2816x1024 Q4_0 mat-vec 1.4 ms here vs
0.2-0.3 ms there, ``python -m ondevice.bench --suite kernels``). F32 weights go to numpy's BLAS
(zero-copy view of the mmap). Without numba every quantized call falls back to dequantise-then-BLAS,
which is correct but ~10x slower.

Why numba and not XLA: XLA:CPU has no dot on packed Q4_0/Q8_0 blocks, so a jitted graph would dequantise
the weights every step; even the jitted f32 decode step runs ~7x slower than the planes path
(``python -m ondevice.bench --suite single``, its ``jax_f32`` entry).

Layouts (ggml): a row of n_in weights is n_in/32 blocks.
  Q8_0 block (34 B): f16 scale d, 32 x int8 q          -> w = d * q
  Q4_0 block (18 B): f16 scale d, 16 bytes of nibbles  -> w[j] = d * ((qs[j] & 15) - 8),
                                                          w[j+16] = d * ((qs[j] >> 4) - 8)
"""
from __future__ import annotations

import os

import numpy as np

from ondevice import kquants
from ondevice.planes import act_q8  # first: it sets numba's vector width before any compile

try:
  import numba
  HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is absent
  numba = None
  HAVE_NUMBA = False


class _NoNumba:  # lets the kernel bodies below be defined (never called) without numba
  prange = range


if not HAVE_NUMBA:
  numba = _NoNumba()  # noqa: F811

QK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}

# f16 bit pattern -> f32; 256 KiB table stays in L2 and avoids unaligned 2-byte loads in the kernels.
_F16_LUT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def _q8_0_matmul_py(w_i8, xq_TxI, lut, n_out, n_in):  # pragma: no cover - compiled
  # mmap layout, 34-byte blocks read in place; xq = act_q8's dequantised activations.
  T = xq_TxI.shape[0]
  nb = n_in // 32
  w_u8 = w_i8.view(np.uint8)
  out = np.zeros((T, n_out), np.float32)
  for o in numba.prange(n_out):
    row = o * nb * 34
    for t in range(T):
      acc = np.float32(0.0)
      for b in range(nb):
        base = row + b * 34
        d = lut[np.int32(w_u8[base]) | (np.int32(w_u8[base + 1]) << 8)]
        s = np.float32(0.0)
        for j in range(32):
          s += np.float32(w_i8[base + 2 + j]) * xq_TxI[t, b * 32 + j]
        acc += d * s
      out[t, o] = acc
  return out


def _q4_0_matmul_py(w_u8, xq_TxI, xs_TxB, lut, n_out, n_in):  # pragma: no cover - compiled
  # mmap layout: sum(d*(q-8)*x) = d*(sum(q*x) - 8*sum(x)), block sums of x shared by every row.
  T = xq_TxI.shape[0]
  nb = n_in // 32
  out = np.zeros((T, n_out), np.float32)
  for o in numba.prange(n_out):
    row = o * nb * 18
    for t in range(T):
      acc = np.float32(0.0)
      for b in range(nb):
        base = row + b * 18
        d = lut[np.int32(w_u8[base]) | (np.int32(w_u8[base + 1]) << 8)]
        s = np.float32(0.0)
        for j in range(16):
          q = np.int32(w_u8[base + 2 + j])
          s += np.float32(q & 15) * xq_TxI[t, b * 32 + j] + np.float32(q >> 4) * xq_TxI[t, b * 32 + 16 + j]
        acc += d * (s - np.float32(8.0) * xs_TxB[t, b])
      out[t, o] = acc
  return out


def _f16_matmul_py(w_OxI_u16, x_TxI, lut):  # pragma: no cover - compiled
  T = x_TxI.shape[0]
  n_out, n_in = w_OxI_u16.shape
  out = np.zeros((T, n_out), np.float32)
  for o in numba.prange(n_out):
    for t in range(T):
      s = np.float32(0.0)
      for i in range(n_in):
        s += lut[w_OxI_u16[o, i]] * x_TxI[t, i]
      out[t, o] = s
  return out


_compiled: dict = {}
_threads = int(os.environ.get("ONDEVICE_THREADS", "1"))


def set_threads(n: int) -> None:
  """Kernel threads. 1 (default) runs serial kernels: on a shared 2-core machine numba's parallel
  runtime was measured 10-100x slower under load (threads spin while other jobs hold the cores)."""
  global _threads
  _threads = max(1, int(n))


def _kernel(name: str):
  parallel = _threads > 1
  key = (name, parallel)
  f = _compiled.get(key)
  if f is None:
    f = numba.njit(parallel=parallel, fastmath=True, cache=not parallel)(globals()[name])
    _compiled[key] = f
  if parallel:
    numba.set_num_threads(min(_threads, numba.config.NUMBA_NUM_THREADS))
  return f


def dequantize_rows(qtype: str, raw_OxR: np.ndarray, n_in: int) -> np.ndarray:
  """Dequantises a few rows (embedding lookups, fallback path) into f32 (n, n_in)."""
  if qtype == "F32":
    return np.asarray(raw_OxR, np.float32)
  if qtype == "F16":
    return np.asarray(raw_OxR).astype(np.float32)
  if qtype == "BF16":  # ggml_bf16_to_fp32: the bits in the upper half
    return (np.asarray(raw_OxR).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
  if qtype in kquants.BLOCK_BYTES:
    return kquants.dequantize_rows(qtype, raw_OxR, n_in)
  nb = n_in // QK
  blocks = np.asarray(raw_OxR).reshape(-1, nb, BLOCK_BYTES[qtype])
  d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # (n, nb, 1)
  if qtype == "Q8_0":
    q = blocks[..., 2:].view(np.int8).astype(np.float32)
  else:
    qs = blocks[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32) - 8.0
  return (d * q).reshape(-1, n_in)


def matmul(qtype: str, w: np.ndarray, x_TxI: np.ndarray, n_out: int, n_in: int) -> np.ndarray:
  """x_TxI @ W.T for a packed weight W (n_out, n_in) -> T x n_out, float32, on the mmap layout.

  ``w`` is the zero-copy view of the tensor: float32/float16 (n_out, n_in) or uint8 (n_out, row_bytes).
  Q8_0/Q4_0 quantise the activations first (ggml semantics), also in the no-numba fallback.
  """
  x_TxI = np.ascontiguousarray(x_TxI, np.float32)
  if qtype == "F32":
    return x_TxI @ w.T
  if qtype in kquants.BLOCK_BYTES or qtype == "BF16":  # dequantise-then-BLAS (planes have the exact kernels)
    return x_TxI @ dequantize_rows(qtype, w, n_in).T
  if not HAVE_NUMBA:
    xq = act_q8(x_TxI)[0] if qtype in BLOCK_BYTES else x_TxI
    return xq @ dequantize_rows(qtype, w, n_in).T
  if qtype == "F16":
    return _kernel("_f16_matmul_py")(w.view(np.uint16), x_TxI, _F16_LUT)
  flat = w.reshape(-1)
  if qtype == "Q8_0":
    xq, _ = act_q8(x_TxI)
    return _kernel("_q8_0_matmul_py")(flat.view(np.int8), xq, _F16_LUT, n_out, n_in)
  if qtype == "Q4_0":
    xq, xs = act_q8(x_TxI)
    return _kernel("_q4_0_matmul_py")(flat, xq, xs, _F16_LUT, n_out, n_in)
  raise NotImplementedError(f"no kernel for {qtype}; export with --quant f32/f16/q8_0/q4_0")
