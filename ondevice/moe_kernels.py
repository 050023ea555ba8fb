"""ggml's router softmax and SwiGLU for the MoE blocks (``moe.py``), bit for bit as llama.cpp's x86 AVX-512 CPU
build computes them.

* softmax of one row (ggml_soft_max_f32, scale 1, no mask): max; ``ggml_v_expf`` on 16-lane chunks summed in
  double (``simd.vexp_sum``), the remaining n % 16 entries with libm's ``expf`` added one by one in double;
  then every entry times float(1 / sum). With fewer than 16 experts every entry takes the libm path.
* SwiGLU (ggml_vec_swiglu_f32): g / (1 + ggml_v_expf(-g)) * u on 16 lanes (``simd.vswiglu``), the remaining
  entries as ``ggml_silu_f32``: g / (1 + expf(-g)) * u with libm's expf.
Without numba both run in numpy (not exact: numpy's exp is not ggml's).

Quantised experts in the file's own layout (``file_matmul``): Q8_0 / Q4_0 rows as the GGUF stores them (per block
of 32: an f16 scale, then 32 int8 quants or 16 bytes of nibbles, low nibble = quant j, high = quant j + 16),
computed on the mapped bytes without a copy, with the arithmetic of the planes kernels (simd._rows64), so the
same bits as llama.cpp: per block the integer dot with the Q8_0 activation (AVX-512 VNNI ``vpdpbusd``, Q8_0
weights flipped to unsigned and 128 * the activation's quad sums subtracted, Q4_0 minus 8 * its block sum), then
per row fma(float(isum), f16(d_w) * d_x, acc): Q8_0 keeps ggml vec_dot's eight lane accumulators (lane c = quad
c of every block) and their hsum_float_8; Q4_0 one accumulator per row. Q8_0 runs 8 rows per step (4 independent
pairs of rows in 16-lane registers), Q4_0 4 rows (their 4 x 16 nibble bytes in one register).
"""
from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np

from ondevice import nbcache, simd
from ondevice.simd import HAVE_NUMBA

if HAVE_NUMBA:
  import numba
  from llvmlite import ir
  from numba import types as nbt
  from numba.core import cgutils
  from numba.extending import intrinsic
  from ondevice.simd import F32, I8, I16, I32, I64, _call, _dpbusd, _ptr, _vec, vexp_sum, vswiglu


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


# ------------------------------------------------------------------------------------------ experts in place

def _c(t, v):
  return ir.Constant(t, v)


def _splat_n(builder, vals, reps):
  """<len(vals) * reps x float>: each value repeated ``reps`` times, in order."""
  n = len(vals)
  v = ir.Constant(_vec(F32, n), ir.Undefined)
  for i, x in enumerate(vals):
    v = builder.insert_element(v, x, _c(I32, i))
  return builder.shuffle_vector(v, v, _c(_vec(I32, n * reps), [i for i in range(n) for _ in range(reps)]))


def _file_rows(context, builder, sig, args, q4: bool):
  """Q4_0: 4 rows, Q8_0: 8 rows of a file-layout matrix (rows at w[off + r * rb]) times one token (module doc)."""
  (w, off, rb, nb, xq, xd, xs, out, o) = args
  t = sig.args
  vnni = simd.has_vnni()
  v16i, v16f, v64b, v4f = _vec(I32, 16), _vec(F32, 16), _vec(I8, 64), _vec(F32, 4)
  nr, bb = (4, 18) if q4 else (8, 34)
  zero_i = _c(v16i, [0] * 16)
  acc = [cgutils.alloca_once_value(builder, _c(v4f, [0.0] * 4))] if q4 else \
      [cgutils.alloca_once_value(builder, _c(v16f, [0.0] * 16)) for _ in range(4)]
  cat = _c(_vec(I32, 64), list(range(64)))
  with cgutils.for_range(builder, nb) as loop:
    b = loop.index
    bo = builder.mul(b, _c(I64, bb))
    base = [builder.add(builder.add(off, builder.mul(rb, _c(I64, r))), bo) for r in range(nr)]
    dx = builder.load(_ptr(context, builder, t[5], xd, b, F32))
    hs = [builder.load(_ptr(context, builder, t[0], w, base[r], I16), align=1) for r in range(nr)]
    sc = [builder.fmul(builder.fpext(builder.bitcast(h, ir.HalfType()), F32), dx) for h in hs]
    xv = builder.load(_ptr(context, builder, t[4], xq, builder.mul(b, _c(I64, 32)), _vec(I8, 32)), align=1)

    def wload(r, n):
      return builder.load(_ptr(context, builder, t[0], w, builder.add(base[r], _c(I64, 2)), _vec(I8, n)), align=1)
    if q4:
      ws = [wload(r, 16) for r in range(4)]
      c32 = _c(_vec(I32, 32), list(range(32)))
      v = builder.shuffle_vector(builder.shuffle_vector(ws[0], ws[1], c32), builder.shuffle_vector(ws[2], ws[3], c32),
                                 cat)
      lo, hi = builder.and_(v, _c(v64b, [15] * 64)), builder.lshr(v, _c(v64b, [4] * 64))
      xlo = builder.shuffle_vector(xv, xv, _c(_vec(I32, 64), [j for _ in range(4) for j in range(16)]))
      xhi = builder.shuffle_vector(xv, xv, _c(_vec(I32, 64), [16 + j for _ in range(4) for j in range(16)]))
      isum = _dpbusd(builder, _dpbusd(builder, zero_i, lo, xlo, vnni), hi, xhi, vnni)
      und = ir.Constant(v16i, ir.Undefined)
      p = [builder.shuffle_vector(isum, und, _c(_vec(I32, 4), [4 * r + j for r in range(4)])) for j in range(4)]
      s4 = builder.add(builder.add(p[0], p[1]), builder.add(p[2], p[3]))  # integers: any order is exact
      corr = builder.load(_ptr(context, builder, t[6], xs, b, I32))
      cv = builder.insert_element(ir.Constant(_vec(I32, 4), ir.Undefined), corr, _c(I32, 0))
      f = builder.sitofp(builder.sub(s4, builder.shuffle_vector(cv, cv, _c(_vec(I32, 4), [0] * 4))), v4f)
      builder.store(_call(builder, "llvm.fma.v4f32", v4f, [f, _splat_n(builder, sc, 1), builder.load(acc[0])]), acc[0])
    else:
      x2 = builder.shuffle_vector(xv, xv, _c(_vec(I32, 64), list(range(32)) * 2))
      cr = builder.load(_ptr(context, builder, t[6], xs, builder.mul(b, _c(I64, 8)), _vec(I32, 8)), align=4)
      cr2 = builder.shuffle_vector(cr, cr, _c(v16i, list(range(8)) * 2))
      for pr in range(4):
        v = builder.xor(builder.shuffle_vector(wload(2 * pr, 32), wload(2 * pr + 1, 32), cat), _c(v64b, [-128] * 64))
        f = builder.sitofp(builder.sub(_dpbusd(builder, zero_i, v, x2, vnni), cr2), v16f)
        builder.store(_call(builder, "llvm.fma.v16f32", v16f, [f, _splat_n(builder, sc[2 * pr:2 * pr + 2], 8),
                                                                 builder.load(acc[pr])]), acc[pr])
  if q4:
    res = builder.load(acc[0])
  else:  # hsum_float_8 per row: ((l4+l0) + (l6+l2)) + ((l5+l1) + (l7+l3))
    res = ir.Constant(_vec(F32, 8), ir.Undefined)
    for pr in range(4):
      a = builder.load(acc[pr])
      for h in range(2):
        ln = [builder.extract_element(a, _c(I32, 8 * h + i)) for i in range(8)]
        tt = [builder.fadd(ln[4 + i], ln[i]) for i in range(4)]
        res = builder.insert_element(res, builder.fadd(builder.fadd(tt[0], tt[2]), builder.fadd(tt[1], tt[3])),
                                     _c(I32, 2 * pr + h))
  builder.store(res, _ptr(context, builder, t[7], out, o, _vec(F32, nr)), align=4)
  return context.get_dummy_value()


if HAVE_NUMBA:
  @intrinsic
  def _q8_file_rows8(typingctx, w, off, rb, nb, xq, xd, xs8, out, o):
    """out[o:o+8] = rows at w[off + r*rb], r < 8, of a Q8_0 file-layout matrix (nb blocks) times one Q8_0
    activation (int8 xq, scales xd, 128 * quad sums xs8)."""
    return nbt.void(w, nbt.int64, nbt.int64, nbt.int64, xq, xd, xs8, out, nbt.int64), \
        lambda c, b, s, a: _file_rows(c, b, s, a, False)

  @intrinsic
  def _q4_file_rows4(typingctx, w, off, rb, nb, xq, xd, xs4, out, o):
    """As _q8_file_rows8 for 4 Q4_0 rows (xs4: 8 * the activation's block sums)."""
    return nbt.void(w, nbt.int64, nbt.int64, nbt.int64, xq, xd, xs4, out, nbt.int64), \
        lambda c, b, s, a: _file_rows(c, b, s, a, True)


@_jit
def _file_matmul(q4, W, off, n_out, n_in, xq, xd, xs4, xs8, out):  # pragma: no cover - compiled
  nb = n_in // 32
  rb = nb * (18 if q4 else 34)
  for t in range(xq.shape[0]):
    if q4:
      for r in range(0, n_out, 4):
        _q4_file_rows4(W, off + r * rb, rb, nb, xq[t], xd[t], xs4[t], out[t], r)
    else:
      for r in range(0, n_out, 8):
        _q8_file_rows8(W, off + r * rb, rb, nb, xq[t], xd[t], xs8[t], out[t], r)


FILE_ROWS = {"Q8_0": 8, "Q4_0": 4}  # n_out must be a multiple of this for file_matmul


def file_matmul(qtype: str, W: np.ndarray, off: int, n_out: int, n_in: int, act: tuple) -> np.ndarray:
  """T x n_out: the Q8_0 / Q4_0 matrix whose rows start at W[off] (the file's layout) times the activations
  ``act`` = (xq, xd, xs4, xs8) from ``planes_kernels.act_q8`` (module docstring; numba only)."""
  xq, xd, xs4, xs8 = act
  out = np.empty((xq.shape[0], n_out), np.float32)
  _file_matmul(qtype == "Q4_0", W, off, n_out, n_in, xq, xd, xs4, xs8, out)
  return out
