"""Mat-vecs of every weight type the runtime computes on, with ggml's x86 arithmetic (AVX-512 build), bit for bit.

A matrix is a row of ``desc`` (``DESC_*``): its type code, where its bytes start in the planes buffer ``W`` (quants
or row-major halves/floats) and in ``S`` (scales), its 64-row groups, rows and inputs. ``mat_groups`` runs groups
[g0, g1) for T tokens, each type on the activations ggml gives it:
* Q4_0 / Q8_0 (``planes.py`` layout, simd.q4_rows64 / q8_rows64): Q8_0 activations (``planes_kernels.act_q8``).
* Q4_K: llama.cpp repacks it (block_q4_Kx8) and runs ggml_gemv_q4_K_8x8_q8_K for a token and gemm for groups of
  4 tokens (the first T - T%4 of a pass). Both take integer sub-block dots times the 6-bit scales, then per row
  acc = fma(float(isum), f16(d_w)*d_x, acc) and mins = fma(float(sum m_j*bsum_j), f16(dmin_w)*d_x, mins),
  result acc - mins; the gemv does this once per super-block, the gemm once per pair of sub-blocks.
* Q5_K / Q6_K: ggml_vec_dot_q5_K_q8_K / q6_K_q8_K (AVX2 code in the AVX-512 build): eight int32 lanes per row
  (lane k: quants 4k..4k+3 of every 32, times their scale; Q6_K minus 32*(bsum*scale) of sub-blocks 2k, 2k+1),
  per super-block lane = fma(d_x*f16(d_w), float(lane), lane), then hsum_float_8; Q5_K adds
  fma(-d_x*f16(dmin_w), float(sum m_j*bsum_j), summs) per super-block. A pass of >= 8 tokens goes to ggml's
  tiled K-quant kernel instead (ggml-cpu/tiled, VNNI build): see ``q56k_rows``.
* F16: activations rounded to f16; one token: ggml_vec_dot_f16 (4 x 16-lane fma accumulators over 64-element
  steps, (0+2)+(1+3), the 16-lane tree sum, double leftovers); a batch: tinyBLAS (one 16-lane accumulator per
  output, tree sum) when n_in % 16 == 0.
* BF16: activations rounded to bf16; ``simd_k.vdot_bf16`` (vdpbf16ps: ggml_vec_dot_bf16 / tinyBLAS).
* F32: one token ggml_vec_dot_f32 (simd.vdot_f32); a batch tinyBLAS as F16.
Activations for K-quants are Q8_K (``act_q8k``: per 256, iscale = -127/max (the signed value of largest
magnitude), q = round-half-even(x*iscale), d = 1/iscale as float, int sums per 16).
``q4k_rows`` / ``q56k_rows`` here are the K-quant kernels written as plain loops over the planes layout
(``kquants.py``): the readable statement of the arithmetic, tested equal to ``simd_k.py``'s vector code, which
``mat_groups`` runs.
"""
from __future__ import annotations

import numpy as np

from ondevice import nbcache, simd, simd_k
from ondevice.simd import HAVE_NUMBA

if HAVE_NUMBA:
  import numba
  from ondevice.simd import fma32, half_to_float, q4_rows64, q8_rows64, round_f16, vdot_f32
  from ondevice.simd_k import q4k_gemm, q4k_gemv, q5k_tiled, q5k_vec, q6k_tiled, q6k_vec, vdot_bf16

Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32 = range(8)
CODES = {"Q4_0": Q4_0, "Q8_0": Q8_0, "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K, "F16": F16, "BF16": BF16, "F32": F32}
DESC_CODE, DESC_Q, DESC_S, DESC_G, DESC_OUT, DESC_IN = range(6)
NEED_Q8_0, NEED_Q8_K, NEED_F16, NEED_BF16 = 1, 2, 4, 8  # activation formats (bit mask) a type reads


nbcache.prefer_512_bit_vectors()


def _anchor():  # numba's cache locators start from a function of this file
  pass


nbcache.clear_stale(__file__, [simd.__file__, simd_k.__file__], _anchor)


def _jit(f):
  # Exact IEEE everywhere (no fastmath): reassociation or contraction would change the roundings above.
  return numba.njit(fastmath=False, cache=True)(f) if HAVE_NUMBA else f


# ------------------------------------------------------------------------------------------ activations

@_jit
def act_q8k(x_TxI, kq_TxI, kd_TxB, kbs_TxB16):  # pragma: no cover - compiled
  """ggml's quantize_row_q8_K_ref (x86 uses it): blocks of 256."""
  T, n = x_TxI.shape
  for t in range(T):
    for b in range(n // 256):
      amax = np.float32(0.0)
      mx = np.float32(0.0)
      for j in range(256):
        v = x_TxI[t, b * 256 + j]
        if abs(v) > amax:
          amax = abs(v)
          mx = v
      if amax == 0:
        kd_TxB[t, b] = 0.0
        for j in range(256):
          kq_TxI[t, b * 256 + j] = 0
        for j in range(16):
          kbs_TxB16[t, b * 16 + j] = 0
        continue
      iscale = np.float32(-127.0) / mx
      for j in range(16):
        s = 0
        for i in range(16):
          q = min(127, np.int32(np.rint(iscale * x_TxI[t, b * 256 + 16 * j + i])))
          kq_TxI[t, b * 256 + 16 * j + i] = q
          s += q
        kbs_TxB16[t, b * 16 + j] = s
      kd_TxB[t, b] = np.float32(1.0) / iscale


@_jit
def act_f16(x_TxI, xh_TxI):  # pragma: no cover - compiled
  """Activations rounded to f16 (ggml_cpu_fp32_to_fp16), kept as float32 values."""
  T, n = x_TxI.shape
  for t in range(T):
    for i in range(n):
      xh_TxI[t, i] = round_f16(x_TxI[t, i])


@_jit
def act_bf16(x_TxI, xb_TxI):  # pragma: no cover - compiled
  """Activations rounded to bf16 (round half to even, as ggml_cpu_fp32_to_bf16), kept as float32 values."""
  T, n = x_TxI.shape
  u = x_TxI.view(np.uint32)
  o = xb_TxI.view(np.uint32)
  for t in range(T):
    for i in range(n):
      b = u[t, i]
      if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        o[t, i] = (b | np.uint32(0x00400000)) & np.uint32(0xFFFF0000)
      else:
        o[t, i] = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)) << np.uint32(16)


# ------------------------------------------------------------------------------------------ small sums

@_jit
def _h16(W, a):  # pragma: no cover - compiled
  return half_to_float(np.uint16(W[a]) | (np.uint16(W[a + 1]) << np.uint16(8)))


@_jit
def _hsum8(a):  # pragma: no cover - compiled
  """hsum_float_8: ((a4+a0) + (a6+a2)) + ((a5+a1) + (a7+a3))."""
  return ((a[4] + a[0]) + (a[6] + a[2])) + ((a[5] + a[1]) + (a[7] + a[3]))


@_jit
def _reduce16(v):  # pragma: no cover - compiled
  """_mm512_reduce_add_ps as GCC emits it (see simd._reduce16)."""
  t8 = np.empty(8, np.float32)
  for i in range(8):
    t8[i] = v[8 + i] + v[i]
  t4 = np.empty(4, np.float32)
  for i in range(4):
    t4[i] = t8[4 + i] + t8[i]
  return (t4[0] + t4[2]) + (t4[1] + t4[3])


# ------------------------------------------------------------------------------------------ K-quant rows

@_jit
def q4k_rows(W, qb, S, sb, nb, kq, kd, kbs, pairs, out, oo):  # pragma: no cover - compiled
  """64 rows of a Q4_K planes group (quants at W[qb:], scales at S[sb:]) times one Q8_K token -> out[oo:oo+64].
  ``pairs``: the gemm's per-pair accumulation (tokens in groups of 4), else the gemv's per-super-block one."""
  for s in range(4):
    for r in range(16):
      A = np.float32(0.0)
      M = np.float32(0.0)
      for b in range(nb):
        q0 = qb + (s * nb + b) * 2048
        s0 = sb + (s * nb + b) * 320
        dwx = _h16(S, s0 + 2 * r) * kd[b]
        dmx = _h16(S, s0 + 32 + 2 * r) * kd[b]
        tot = 0
        totm = 0
        for p in range(4):
          lo = 0
          hi = 0
          for c in range(8):
            for i in range(4):
              w = np.int32(W[q0 + ((p * 8 + c) * 16 + r) * 4 + i])
              e = b * 256 + 64 * p + 4 * c + i
              lo += (w & 15) * np.int32(kq[e])
              hi += (w >> 4) * np.int32(kq[e + 32])
          ip = np.int32(S[s0 + 64 + 16 * (2 * p) + r]) * lo + np.int32(S[s0 + 64 + 16 * (2 * p + 1) + r]) * hi
          im = (np.int32(S[s0 + 192 + 16 * (2 * p) + r]) * (kbs[b * 16 + 4 * p] + kbs[b * 16 + 4 * p + 1]) +
                np.int32(S[s0 + 192 + 16 * (2 * p + 1) + r]) * (kbs[b * 16 + 4 * p + 2] + kbs[b * 16 + 4 * p + 3]))
          if pairs:
            A = fma32(np.float32(ip), dwx, A)
            M = fma32(np.float32(im), dmx, M)
          else:
            tot += ip
            totm += im
        if not pairs:
          A = fma32(np.float32(tot), dwx, A)
          M = fma32(np.float32(totm), dmx, M)
      out[oo + 16 * s + r] = A - M


@_jit
def q56k_rows(W, qb, S, sb, nb, kq, kd, kbs, is6, tiled, out, oo):  # pragma: no cover - compiled
  """64 rows of a Q5_K (is6 False) or Q6_K planes group times one Q8_K token: ggml's vec_dot lanes, or with
  ``tiled`` the tiled VNNI kernel llama.cpp takes for batches of >= 8 tokens (per super-block the exact integer
  s1 = sum_j sc_j*(dot_j - 32*bsum_j) (Q6_K) or sum_j sc_j*dot_j and s2 = sum_j m_j*bsum_j (Q5_K);
  r = float(s1)*d_w, r = fma(-dmin_w, float(s2), r), out = fma(r, d_x, out))."""
  acc = np.empty(8, np.float32)
  li = np.empty(8, np.int32)
  for s in range(4):
    for r in range(16):
      acc[:] = 0.0
      summs = np.float32(0.0)
      buf = np.float32(0.0)
      for b in range(nb):
        q0 = qb + (s * nb + b) * 4096
        s0 = sb + (s * nb + b) * (288 if is6 else 320)
        li[:] = 0
        s1 = 0
        for ch in range(8):
          for k in range(8):
            dot = 0
            for i in range(4):
              e = b * 256 + 32 * ch + 4 * k + i
              dot += np.int32(W[q0 + ((ch * 8 + k) * 16 + r) * 4 + i]) * np.int32(kq[e])
            if is6:
              sc = np.int32(np.int8(S[s0 + 32 + 16 * (2 * ch + (1 if k >= 4 else 0)) + r]))
            else:
              sc = np.int32(S[s0 + 64 + 16 * ch + r])
            li[k] += sc * dot
            s1 += sc * dot
        dw = _h16(S, s0 + 2 * r)
        im = 0
        if is6:
          for k in range(8):
            c0 = np.int32(np.int8(S[s0 + 32 + 16 * (2 * k) + r]))
            c1 = np.int32(np.int8(S[s0 + 32 + 16 * (2 * k + 1) + r]))
            corr = 32 * (kbs[b * 16 + 2 * k] * c0 + kbs[b * 16 + 2 * k + 1] * c1)
            li[k] -= corr
            s1 -= corr
        else:
          for j in range(8):
            im += np.int32(S[s0 + 192 + 16 * j + r]) * (kbs[b * 16 + 2 * j] + kbs[b * 16 + 2 * j + 1])
        if tiled:
          rr = np.float32(s1) * dw
          if not is6:
            rr = fma32(-_h16(S, s0 + 32 + 2 * r), np.float32(im), rr)
          buf = fma32(rr, kd[b], buf)
          continue
        d = kd[b] * dw
        if not is6:
          dmin = (-kd[b]) * _h16(S, s0 + 32 + 2 * r)
          summs = fma32(np.float32(im), dmin, summs)
        for k in range(8):
          acc[k] = fma32(d, np.float32(li[k]), acc[k])
      if tiled:
        out[oo + 16 * s + r] = buf
      else:
        out[oo + 16 * s + r] = _hsum8(acc) + summs if not is6 else _hsum8(acc)


# ------------------------------------------------------------------------------------------ float rows

@_jit
def f16_row(W, off, n, xh, tiny):  # pragma: no cover - compiled
  """One row of f16 weights (bytes W[off:]) times f16-rounded activations: vec_dot_f16 or tinyBLAS order."""
  if tiny:
    a = np.zeros(16, np.float32)
    for l in range(0, n, 16):
      for j in range(16):
        a[j] = fma32(_h16(W, off + 2 * (l + j)), xh[l + j], a[j])
    return _reduce16(a)
  acc = np.zeros((4, 16), np.float32)
  n64 = n & ~63
  for l in range(0, n64, 64):
    for j in range(4):
      for i in range(16):
        acc[j, i] = fma32(xh[l + 16 * j + i], _h16(W, off + 2 * (l + 16 * j + i)), acc[j, i])
  v = np.empty(16, np.float32)
  for i in range(16):
    v[i] = (acc[0, i] + acc[2, i]) + (acc[1, i] + acc[3, i])
  s = np.float64(_reduce16(v))
  for l in range(n64, n):
    s += np.float64(xh[l] * _h16(W, off + 2 * l))
  return np.float32(s)


@_jit
def f32_row(Wf, off, n, x, tiny):  # pragma: no cover - compiled
  """One row of f32 weights (Wf[off:], float32 view) times x: vec_dot_f32 or tinyBLAS order."""
  if tiny:
    a = np.zeros(16, np.float32)
    for l in range(0, n, 16):
      for j in range(16):
        a[j] = fma32(Wf[off + l + j], x[l + j], a[j])
    return _reduce16(a)
  return vdot_f32(x, 0, Wf, off, n)


# ------------------------------------------------------------------------------------------ dispatch

@_jit
def mat_groups(d, W, S, S16, g0, g1, x, xq32, xd, xs4, xs8, kq, kd, kbs, xh, xb, out, col0, gbase,
               batched):  # pragma: no cover - compiled
  """Row groups [g0, g1) of the matrix ``d`` (a desc row) for every token: out[t, col0 + 64(g - gbase) + r].
  Activations: x (f32), Q8_0 (xq32 int32 view, xd, xs4, xs8), Q8_K (kq, kd, kbs), F16 (xh), BF16 (xb).
  ``batched``: llama.cpp's batched orders (T >= 2 in one pass); False gives every token its one-token result."""
  code, qo, so, n_out, n_in = d[DESC_CODE], d[DESC_Q], d[DESC_S], d[DESC_OUT], d[DESC_IN]
  T = out.shape[0]
  n4 = T - T % 4 if batched else 0
  for g in range(g0, g1):
    o0 = col0 + (g - gbase) * 64
    for t in range(T):
      if code == Q4_0:
        nb = n_in // 32
        q4_rows64(W, qo + g * nb * 1024, S16, so // 2 + g * nb * 64, nb, xq32[t], 0, xd[t], xs4[t], 0, out[t], o0)
      elif code == Q8_0:
        nb = n_in // 32
        q8_rows64(W, qo + g * nb * 2048, S16, so // 2 + g * nb * 64, nb, xq32[t], 0, xd[t], xs8[t], 0, out[t], o0)
      elif code == Q4_K:
        nb = n_in // 256
        if t < n4:
          q4k_gemm(W, qo + g * nb * 8192, S, so + g * nb * 1280, nb, kq[t].view(np.int32), 0, kd[t], kbs[t], out[t], o0)
        else:
          q4k_gemv(W, qo + g * nb * 8192, S, so + g * nb * 1280, nb, kq[t].view(np.int32), 0, kd[t], kbs[t], out[t], o0)
      elif code == Q5_K or code == Q6_K:
        nb = n_in // 256
        qb, sb, x32 = qo + g * nb * 16384, so + g * nb * (1152 if code == Q6_K else 1280), kq[t].view(np.int32)
        if code == Q6_K:
          if batched and T >= 8:
            q6k_tiled(W, qb, S, sb, nb, x32, 0, kd[t], kbs[t], out[t], o0)
          else:
            q6k_vec(W, qb, S, sb, nb, x32, 0, kd[t], kbs[t], out[t], o0)
        elif batched and T >= 8:
          q5k_tiled(W, qb, S, sb, nb, x32, 0, kd[t], kbs[t], out[t], o0)
        else:
          q5k_vec(W, qb, S, sb, nb, x32, 0, kd[t], kbs[t], out[t], o0)
      else:
        tiny = batched and n_in % 16 == 0
        for r in range(min(64, n_out - 64 * g)):
          if code == F16:
            out[t, o0 + r] = f16_row(W, qo + 2 * (64 * g + r) * n_in, n_in, xh[t], tiny)
          elif code == BF16:
            out[t, o0 + r] = vdot_bf16(xb[t], 0, W.view(np.uint16), qo // 2 + (64 * g + r) * n_in, n_in,
                                       batched and n_in % 32 == 0)
          else:
            out[t, o0 + r] = f32_row(W.view(np.float32), qo // 4 + (64 * g + r) * n_in, n_in, x[t], tiny)
