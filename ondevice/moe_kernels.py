"""ggml's router softmax and SwiGLU for the MoE blocks (``moe.py``), bit for bit as llama.cpp's x86 AVX-512 CPU
build computes them.

* softmax of one row (ggml_soft_max_f32, scale 1, no mask): max; ``ggml_v_expf`` on 16-lane chunks summed in
  double (``simd.vexp_sum``), the remaining n % 16 entries with libm's ``expf`` added one by one in double;
  then every entry times float(1 / sum). With fewer than 16 experts every entry takes the libm path.
* SwiGLU (ggml_vec_swiglu_f32): g / (1 + ggml_v_expf(-g)) * u on 16 lanes (``simd.vswiglu``), the remaining
  entries as ``ggml_silu_f32``: g / (1 + expf(-g)) * u with libm's expf.
Without numba both run in numpy (not exact: numpy's exp is not ggml's).
"""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

from ondevice import nbcache, simd
from ondevice.simd import HAVE_NUMBA

if HAVE_NUMBA:
  import numba
  from ondevice.simd import vexp_sum, vswiglu


def _anchor():  # numba's cache locators start from a function of this file
  pass


nbcache.prefer_512_bit_vectors()
nbcache.clear_stale(__file__, [simd.__file__], _anchor)


def _jit(f):
  return numba.njit(fastmath=False, cache=True, nogil=True)(f) if HAVE_NUMBA else f


_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_LIBM.expf.restype = ctypes.c_float
_LIBM.expf.argtypes = (ctypes.c_float,)


def expf(x) -> np.float32:
  """libm's expf (glibc), as ggml's scalar leftovers call it."""
  return np.float32(_LIBM.expf(np.float32(x)))


@_jit
def _exp_chunks(buf, m, n16):  # pragma: no cover - compiled
  return vexp_sum(buf, m, n16)


@_jit
def _swiglu16(g, u, out, n16):  # pragma: no cover - compiled
  for t in range(g.shape[0]):
    vswiglu(g[t], 0, u[t], 0, out[t], 0, n16)


def softmax(x_N: np.ndarray) -> np.ndarray:
  """One row's ggml softmax (module docstring)."""
  x = np.ascontiguousarray(x_N, np.float32)
  n = x.size
  mx = np.float32(x.max())
  y = np.empty(n, np.float32)
  n16 = n // 16 if HAVE_NUMBA else 0
  s = 0.0
  if n16:
    y[:16 * n16] = x[:16 * n16]
    s = float(_exp_chunks(y, mx, n16))
  for i in range(16 * n16, n):
    v = expf(np.float32(x[i] - mx)) if HAVE_NUMBA else np.float32(np.exp(np.float32(x[i] - mx)))
    s += float(v)
    y[i] = v
  return y * np.float32(1.0 / s)


def swiglu(g_TxF: np.ndarray, u_TxF: np.ndarray) -> np.ndarray:
  """SwiGLU of gate rows g and up rows u (module docstring)."""
  g = np.ascontiguousarray(g_TxF, np.float32)
  u = np.ascontiguousarray(u_TxF, np.float32)
  out = np.empty_like(g)
  F = g.shape[1]
  n16 = F // 16 if HAVE_NUMBA else 0
  if n16:
    _swiglu16(g, u, out, n16)
  for t in range(g.shape[0]):
    for f in range(16 * n16, F):
      e = expf(-g[t, f]) if HAVE_NUMBA else np.float32(np.exp(-g[t, f]))
      out[t, f] = g[t, f] / (np.float32(1.0) + e) * u[t, f]
  return out


@_jit
def _repack_q0(raw, n_rows, nb, bb, nq, xor, q, s):  # pragma: no cover - compiled
  for row in range(n_rows):
    g, rr = row // 64, row % 64
    sg, r = rr // 16, rr % 16
    for b in range(nb):
      base = (row * nb + b) * bb
      s[g, b * 64 + rr] = np.uint16(raw[base]) | (np.uint16(raw[base + 1]) << np.uint16(8))
      for c in range(nq):
        d = (((b * 4 + sg) * nq + c) * 16 + r) * 4
        for i in range(4):
          q[g, d + i] = raw[base + 2 + c * 4 + i] ^ xor


def repack_q0(qtype: str, raw: np.ndarray, n_rows: int, n_in: int) -> tuple:
  """``planes._repack_q0`` in one compiled pass (the same bytes; ~20x faster than numpy's 6-D transposes, which
  matters when quantised experts are repacked at every cache miss)."""
  nb = n_in // 32
  bb, nq, xor = (34, 8, 0x80) if qtype == "Q8_0" else (18, 4, 0)
  G = -(-n_rows // 64)
  q = np.full((G, nb * 64 * nq * 4), xor, np.uint8)
  s = np.zeros((G, nb * 64), np.uint16)
  _repack_q0(np.ascontiguousarray(raw, np.uint8).reshape(-1), n_rows, nb, bb, nq, np.uint8(xor), q, s)
  return q, s
