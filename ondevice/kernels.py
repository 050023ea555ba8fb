"""Mat-muls on packed GGUF weights (F32, F16, Q8_0, Q4_0) without materialising f32 copies.

Why numba and not XLA: on this CPU XLA's quantized dot / in-graph dequantisation runs 30-100x slower
than an f32 mat-vec (shared/notes/ondevice.md, addendum), while a parallel numba loop over the packed
blocks reads 3.5-7x fewer bytes than f32 and runs at memory speed. F32 weights go to numpy's BLAS
(zero-copy view of the mmap). Without numba every quantized call falls back to dequantise-then-BLAS,
which is correct but ~10x slower (it materialises the f32 rows, which is what we want to avoid).

Layouts (ggml): a row of n_in weights is n_in/32 blocks.
  Q8_0 block (34 B): f16 scale d, 32 x int8 q          -> w = d * q
  Q4_0 block (18 B): f16 scale d, 16 bytes of nibbles  -> w[j] = d * ((qs[j] & 15) - 8),
                                                          w[j+16] = d * ((qs[j] >> 4) - 8)
"""
from __future__ import annotations

import numpy as np

try:
  import numba
  HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is absent
  numba = None
  HAVE_NUMBA = False

QK = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}

# f16 bit pattern -> f32; 256 KiB table stays in L2 and avoids unaligned 2-byte loads in the kernels.
_F16_LUT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


if HAVE_NUMBA:
  @numba.njit(parallel=True, fastmath=True, cache=True)
  def _q8_0_matmul(w_u8, x_TxI, lut, n_out, n_in):  # pragma: no cover - compiled
    T = x_TxI.shape[0]
    nb = n_in // 32
    out = np.zeros((T, n_out), np.float32)
    for o in numba.prange(n_out):
      row = o * nb * 34
      for t in range(T):
        acc = np.float32(0.0)
        for b in range(nb):
          base = row + b * 34
          d = lut[np.int32(w_u8[base]) | (np.int32(w_u8[base + 1]) << 8)]
          s = np.float32(0.0)
          xb = b * 32
          for j in range(32):
            q = np.int32(w_u8[base + 2 + j])
            q = q - ((q & 128) << 1)  # uint8 -> int8
            s += np.float32(q) * x_TxI[t, xb + j]
          acc += d * s
        out[t, o] = acc
    return out

  @numba.njit(parallel=True, fastmath=True, cache=True)
  def _q4_0_matmul(w_u8, x_TxI, lut, n_out, n_in):  # pragma: no cover - compiled
    T = x_TxI.shape[0]
    nb = n_in // 32
    # sum(d*(q-8)*x) = d*(sum(q*x) - 8*sum(x)): the block sums of x are shared by every row.
    xsum = np.zeros((T, nb), np.float32)
    for t in range(T):
      for b in range(nb):
        s = np.float32(0.0)
        for j in range(32):
          s += x_TxI[t, b * 32 + j]
        xsum[t, b] = s
    out = np.zeros((T, n_out), np.float32)
    for o in numba.prange(n_out):
      row = o * nb * 18
      buf = np.empty(32, np.float32)
      for b in range(nb):
        base = row + b * 18
        d = lut[np.int32(w_u8[base]) | (np.int32(w_u8[base + 1]) << 8)]
        for j in range(16):  # unpack the block once into a small f32 buffer, then a plain dot
          q = w_u8[base + 2 + j]
          buf[j] = np.float32(q & 15)
          buf[j + 16] = np.float32(q >> 4)
        for t in range(T):
          s = np.float32(0.0)
          for j in range(32):
            s += buf[j] * x_TxI[t, b * 32 + j]
          out[t, o] += d * (s - np.float32(8.0) * xsum[t, b])
    return out

  @numba.njit(parallel=True, fastmath=True, cache=True)
  def _f16_matmul(w_OxI_u16, x_TxI, lut):  # pragma: no cover - compiled
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


def dequantize_rows(qtype: str, raw_OxR: np.ndarray, n_in: int) -> np.ndarray:
  """Dequantises a few rows (embedding lookups, fallback path) into f32 (n, n_in)."""
  if qtype == "F32":
    return np.asarray(raw_OxR, np.float32)
  if qtype == "F16":
    return np.asarray(raw_OxR).astype(np.float32)
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
  """x_TxI @ W.T for a packed weight W (n_out, n_in) -> T x n_out, float32.

  ``w`` is the zero-copy view of the tensor: float32/float16 (n_out, n_in) or uint8 (n_out, row_bytes).
  """
  x_TxI = np.ascontiguousarray(x_TxI, np.float32)
  if qtype == "F32":
    return x_TxI @ w.T
  if not HAVE_NUMBA:
    return x_TxI @ dequantize_rows(qtype, w, n_in).T
  if qtype == "F16":
    return _f16_matmul(w.view(np.uint16), x_TxI, _F16_LUT)
  flat = w.reshape(-1)
  if qtype == "Q8_0":
    return _q8_0_matmul(flat, x_TxI, _F16_LUT, n_out, n_in)
  if qtype == "Q4_0":
    return _q4_0_matmul(flat, x_TxI, _F16_LUT, n_out, n_in)
  raise NotImplementedError(f"no kernel for {qtype}; export with --quant f32/f16/q8_0/q4_0")
