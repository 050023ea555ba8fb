"""The compiled numba code behind ``ondevice/planes.py``: the planes mat-mul kernels and a fused decoder layer.

Weights arrive in the planes layout that ``planes.repack`` builds: for each (row group g of R=64 rows,
block b) one contiguous run holds the R rows' f32 scales, then, position by position, the R rows' nibble
bytes (Q4_0: 16 bytes = 32 weights per row) or int8s (Q8_0). The innermost loops run over the R rows with
contiguous loads and no horizontal sum, and LLVM emits zmm code for them (``planes.inspect_asm``).

Semantics are ggml's CPU backend on x86: activations are quantised to Q8_0 (``_act_q8_py``) for Q8_0
and Q4_0 weights alike, the dot is exact per block up to float32 rounding (dequantised activations are
multiplied instead of summing int32s), and RMSNorm reproduces ggml's roundings.

``_layer_py`` runs a whole llama block (RMSNorm, QKV, RoPE, KV write, GQA attention, output projection,
SwiGLU FFN) in one numba call instead of ~40 numpy/numba calls (that glue is ~3.5 ms of a 21 ms token
on the 203M model), and ``_layers_py`` runs all blocks of a ``planes.Stack`` in one call (another 0.4 ms
per token).

Why a file of its own: numba caches compiled code per file (``cache=True``) and does not notice when a
jitted function that another one calls changes in a different file. So every jitted function that calls
another, and the intrinsics they inline, live here and only here: editing this file invalidates all of
their cached code together, and editing the Python-side layout and API in ``planes.py`` invalidates none.
"""
from __future__ import annotations

import os

import numpy as np

try:
  import numba
  from llvmlite import ir
  from numba import types as nbt
  from numba.core import cgutils
  from numba.extending import intrinsic
  HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is absent
  HAVE_NUMBA = False

  def intrinsic(f):  # noqa: D103 - placeholder so the module imports
    return f

QK = 32
R = 64  # rows per plane group: one 64-byte cache line per (group, block, position)
PREFETCH_BYTES = 4096  # prefetch distance ahead of the current (group, block); 2-16 KiB measured alike


def _prefer_512_bit_vectors() -> None:
  """LLVM vectorises with 256-bit registers on AVX-512 Intel CPUs by default (feature prefer-256-bit,
  against the clock drop of older parts). The planes kernels run 1.3-1.4x faster with zmm on an AVX-512
  host (Q4_0 0.23 vs 0.32 ms streamed). numba reads its CPU features once, at its first compilation, for the whole
  process, so this only takes effect if no numba code was compiled before this import; ONDEVICE_ZMM=0
  or an explicit NUMBA_CPU_FEATURES leaves numba's default alone."""
  if not HAVE_NUMBA or os.environ.get("ONDEVICE_ZMM", "1") == "0" or numba.config.CPU_FEATURES is not None:
    return
  from llvmlite import binding
  feats = binding.get_host_cpu_features().flatten()
  if "+avx512f" in feats.split(","):
    numba.config.CPU_FEATURES = feats + ",-prefer-256-bit"


_prefer_512_bit_vectors()


@intrinsic
def _prefetch(typingctx, arr, idx):
  """llvm.prefetch(&arr[idx]) for reading into all cache levels. Never faults, so it may point past the end."""
  def codegen(context, builder, sig, args):
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    i8p = ir.IntType(8).as_pointer()
    ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
    return context.get_dummy_value()
  return nbt.void(arr, idx), codegen


@intrinsic
def _round_f16(typingctx, x):
  """float32 -> nearest float16 -> float32 (ggml stores Q8_0 activation scales as f16); numba has no float16."""
  def codegen(context, builder, sig, args):
    return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
  return nbt.float32(nbt.float32), codegen


# fastmath without reassoc: the kernels' row loops are elementwise (no reductions to reorder), and a fixed
# association keeps each token's result independent of how many tokens share the call.
_NO_REASSOC = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}


def _jit(f=None, fastmath=True):
  # cache=True: these take seconds to compile, which every short CLI run would pay again.
  if f is None:
    return lambda g: _jit(g, fastmath)
  return numba.njit(fastmath=fastmath, cache=True)(f) if HAVE_NUMBA else f


# ------------------------------------------------------------------------------------------ kernels

@_jit(fastmath=False)  # exact IEEE: 127/amax and rint must round as ggml's do, or a q can flip
def _act_q8_py(x_TxI, xq_TxI, xs_TxB):  # pragma: no cover - compiled
  """ggml's x86 quantize_row_q8_0 on activations, written back dequantised: d = amax/127 stored as f16,
  q = round-half-even(x * 127/amax), x' = q * f16(d); plus the per-32 block sums of x' (Q4_0's -8 term)."""
  T, n_in = x_TxI.shape
  for t in range(T):
    for b in range(n_in // 32):
      amax = np.float32(0.0)
      for j in range(32):
        amax = max(amax, abs(x_TxI[t, b * 32 + j]))
      inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
      d16 = _round_f16(amax / np.float32(127.0))
      s = np.float32(0.0)
      for j in range(32):
        q = np.rint(x_TxI[t, b * 32 + j] * inv)
        xq_TxI[t, b * 32 + j] = q * d16
        s += q
      xs_TxB[t, b] = s * d16


@_jit(fastmath=_NO_REASSOC)
def _q4_0_planes_py(buf, xq_TxI, xs_TxB, out_TxO):  # pragma: no cover - compiled
  # w = d*(q-8): sum_j w*x = d*(sum_j q*x - 8*sum_j x). The inner loops run over R rows, which is what
  # vectorises; nibbles are split in float (hi = floor(q/16), lo = q - 16 hi): numba widens integer
  # and/shift to int64, which is slower (0.25 vs 0.19 ms hot). Two bytes (4 weights) per pass over
  # tmp. Tokens go four at a time (each unpacked weight serves four), then one by one; a token's
  # expression is the same either way and reassociation is off, so its result does not depend on T.
  G, B, _ = buf.shape
  T = xq_TxI.shape[0]
  flat = buf.reshape(-1)
  scales = flat.view(np.float32)
  ta, tb, tc, td = (np.empty(R, np.float32), np.empty(R, np.float32), np.empty(R, np.float32),
                    np.empty(R, np.float32))
  for g in range(G):
    o0 = g * R
    for t in range(T):
      for r in range(R):
        out_TxO[t, o0 + r] = 0.0
    for b in range(B):
      base = (g * B + b) * 20 * R
      for line in range(20 * R // 64):
        _prefetch(flat, base + PREFETCH_BYTES + 64 * line)
      d0 = base // 4
      t = 0
      while t + 4 <= T:
        for r in range(R):
          ta[r] = -(np.float32(8.0) * xs_TxB[t, b])
          tb[r] = -(np.float32(8.0) * xs_TxB[t + 1, b])
          tc[r] = -(np.float32(8.0) * xs_TxB[t + 2, b])
          td[r] = -(np.float32(8.0) * xs_TxB[t + 3, b])
        xa, xb, xc, xd = xq_TxI[t], xq_TxI[t + 1], xq_TxI[t + 2], xq_TxI[t + 3]
        for j in range(0, 16, 2):
          col = b * 32 + j
          al0, ah0, al1, ah1 = xa[col], xa[col + 16], xa[col + 1], xa[col + 17]
          bl0, bh0, bl1, bh1 = xb[col], xb[col + 16], xb[col + 1], xb[col + 17]
          cl0, ch0, cl1, ch1 = xc[col], xc[col + 16], xc[col + 1], xc[col + 17]
          dl0, dh0, dl1, dh1 = xd[col], xd[col + 16], xd[col + 1], xd[col + 17]
          n0 = base + 4 * R + j * R
          for r in range(R):
            q0 = np.float32(flat[n0 + r])
            q1 = np.float32(flat[n0 + R + r])
            h0 = np.floor(q0 * np.float32(0.0625))
            h1 = np.floor(q1 * np.float32(0.0625))
            l0 = q0 - np.float32(16.0) * h0
            l1 = q1 - np.float32(16.0) * h1
            ta[r] += ((al0 * l0 + ah0 * h0) + al1 * l1) + ah1 * h1
            tb[r] += ((bl0 * l0 + bh0 * h0) + bl1 * l1) + bh1 * h1
            tc[r] += ((cl0 * l0 + ch0 * h0) + cl1 * l1) + ch1 * h1
            td[r] += ((dl0 * l0 + dh0 * h0) + dl1 * l1) + dh1 * h1
        for r in range(R):
          out_TxO[t, o0 + r] += scales[d0 + r] * ta[r]
          out_TxO[t + 1, o0 + r] += scales[d0 + r] * tb[r]
          out_TxO[t + 2, o0 + r] += scales[d0 + r] * tc[r]
          out_TxO[t + 3, o0 + r] += scales[d0 + r] * td[r]
        t += 4
      while t < T:
        for r in range(R):
          ta[r] = -(np.float32(8.0) * xs_TxB[t, b])
        xa = xq_TxI[t]
        for j in range(0, 16, 2):
          col = b * 32 + j
          al0, ah0, al1, ah1 = xa[col], xa[col + 16], xa[col + 1], xa[col + 17]
          n0 = base + 4 * R + j * R
          for r in range(R):
            q0 = np.float32(flat[n0 + r])
            q1 = np.float32(flat[n0 + R + r])
            h0 = np.floor(q0 * np.float32(0.0625))
            h1 = np.floor(q1 * np.float32(0.0625))
            l0 = q0 - np.float32(16.0) * h0
            l1 = q1 - np.float32(16.0) * h1
            ta[r] += ((al0 * l0 + ah0 * h0) + al1 * l1) + ah1 * h1
        for r in range(R):
          out_TxO[t, o0 + r] += scales[d0 + r] * ta[r]
        t += 1


@_jit(fastmath=_NO_REASSOC)
def _q8_0_planes_py(buf, xq_TxI, xs_TxB, out_TxO):  # pragma: no cover - compiled
  # As the Q4_0 kernel: 4 positions per pass over tmp, tokens four at a time then one by one.
  G, B, _ = buf.shape
  T = xq_TxI.shape[0]
  flat = buf.reshape(-1)
  qs = flat.view(np.int8)
  scales = flat.view(np.float32)
  ta, tb, tc, td = (np.empty(R, np.float32), np.empty(R, np.float32), np.empty(R, np.float32),
                    np.empty(R, np.float32))
  for g in range(G):
    o0 = g * R
    for t in range(T):
      for r in range(R):
        out_TxO[t, o0 + r] = 0.0
    for b in range(B):
      base = (g * B + b) * 36 * R
      for line in range(36 * R // 64):
        _prefetch(flat, base + PREFETCH_BYTES + 64 * line)
      d0 = base // 4
      t = 0
      while t + 4 <= T:
        for r in range(R):
          ta[r] = 0.0
          tb[r] = 0.0
          tc[r] = 0.0
          td[r] = 0.0
        xa, xb, xc, xd = xq_TxI[t], xq_TxI[t + 1], xq_TxI[t + 2], xq_TxI[t + 3]
        for j in range(0, 32, 4):
          col = b * 32 + j
          a0, a1, a2, a3 = xa[col], xa[col + 1], xa[col + 2], xa[col + 3]
          b0, b1, b2, b3 = xb[col], xb[col + 1], xb[col + 2], xb[col + 3]
          c0, c1, c2, c3 = xc[col], xc[col + 1], xc[col + 2], xc[col + 3]
          e0, e1, e2, e3 = xd[col], xd[col + 1], xd[col + 2], xd[col + 3]
          n0 = base + 4 * R + j * R
          for r in range(R):
            w0, w1 = np.float32(qs[n0 + r]), np.float32(qs[n0 + R + r])
            w2, w3 = np.float32(qs[n0 + 2 * R + r]), np.float32(qs[n0 + 3 * R + r])
            ta[r] += ((a0 * w0 + a1 * w1) + a2 * w2) + a3 * w3
            tb[r] += ((b0 * w0 + b1 * w1) + b2 * w2) + b3 * w3
            tc[r] += ((c0 * w0 + c1 * w1) + c2 * w2) + c3 * w3
            td[r] += ((e0 * w0 + e1 * w1) + e2 * w2) + e3 * w3
        for r in range(R):
          out_TxO[t, o0 + r] += scales[d0 + r] * ta[r]
          out_TxO[t + 1, o0 + r] += scales[d0 + r] * tb[r]
          out_TxO[t + 2, o0 + r] += scales[d0 + r] * tc[r]
          out_TxO[t + 3, o0 + r] += scales[d0 + r] * td[r]
        t += 4
      while t < T:
        for r in range(R):
          ta[r] = 0.0
        xa = xq_TxI[t]
        for j in range(0, 32, 4):
          col = b * 32 + j
          a0, a1, a2, a3 = xa[col], xa[col + 1], xa[col + 2], xa[col + 3]
          n0 = base + 4 * R + j * R
          for r in range(R):
            w0, w1 = np.float32(qs[n0 + r]), np.float32(qs[n0 + R + r])
            w2, w3 = np.float32(qs[n0 + 2 * R + r]), np.float32(qs[n0 + 3 * R + r])
            ta[r] += ((a0 * w0 + a1 * w1) + a2 * w2) + a3 * w3
        for r in range(R):
          out_TxO[t, o0 + r] += scales[d0 + r] * ta[r]
        t += 1


@_jit
def _planes_matmul(buf, is_q4, x_TxI):  # pragma: no cover - compiled
  """act_q8(x) then the planes kernel: T x (G*R) (padded rows included)."""
  T, n_in = x_TxI.shape
  xq = np.empty((T, n_in), np.float32)
  xs = np.empty((T, n_in // 32), np.float32)
  _act_q8_py(x_TxI, xq, xs)
  out = np.empty((T, buf.shape[0] * R), np.float32)
  if is_q4:
    _q4_0_planes_py(buf, xq, xs, out)
  else:
    _q8_0_planes_py(buf, xq, xs, out)
  return out


@_jit(fastmath=False)
def _rms_norm(x_TxD, w_D, eps):  # pragma: no cover - compiled
  """ggml's rms_norm bit for bit: float squares summed in double, mean and scale in float, then * w.
  It matters: Q8_0 activation quantisation of a quantised embedding hits exact .5 ties, and which way
  they round depends on the last bit of the normalised input."""
  T, D = x_TxD.shape
  out = np.empty((T, D), np.float32)
  for t in range(T):
    ss = 0.0
    for i in range(D):
      ss += np.float64(x_TxD[t, i] * x_TxD[t, i])
    mean = np.float32(ss / D)
    sc = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    for i in range(D):
      out[t, i] = (x_TxD[t, i] * sc) * w_D[i]
  return out


@_jit
def _rope(x_TxC, off, n, E, cos_SxE2, sin_SxE2, pos0):  # pragma: no cover - compiled
  """In place: adjacent-pair rotation (llama.cpp NORM mode) of n heads of E starting at column off."""
  for t in range(x_TxC.shape[0]):
    for h in range(n):
      c0 = off + h * E
      for i in range(E // 2):
        c, s = cos_SxE2[pos0 + t, i], sin_SxE2[pos0 + t, i]
        a, b = x_TxC[t, c0 + 2 * i], x_TxC[t, c0 + 2 * i + 1]
        x_TxC[t, c0 + 2 * i] = a * c - b * s
        x_TxC[t, c0 + 2 * i + 1] = a * s + b * c


@_jit
def _attention(qkv_TxC, k_SxKxE, v_SxKxE, pos0, H, K, E):  # pragma: no cover - compiled
  """Causal GQA over the cache rows < pos0 + t + 1 for each query t; q = qkv[:, :H*E]. -> T x H*E.
  The G query heads of one KV head are done together, so each K/V row is read once for all of them;
  query and accumulator live in small local arrays (the row loops over E then vectorise without
  alias checks against the cache)."""
  T = qkv_TxC.shape[0]
  G = H // K
  scale = np.float32(1.0) / np.sqrt(np.float32(E))
  out = np.empty((T, H * E), np.float32)
  p_GxS = np.empty((G, pos0 + T), np.float32)
  q_GxE = np.empty((G, E), np.float32)
  acc_GxE = np.empty((G, E), np.float32)
  m_G = np.empty(G, np.float32)
  for t in range(T):
    S = pos0 + t + 1
    for kv in range(K):
      for g in range(G):
        for e in range(E):
          q_GxE[g, e] = qkv_TxC[t, (kv * G + g) * E + e] * scale
          acc_GxE[g, e] = 0.0
        m_G[g] = np.float32(-3.0e38)  # not -inf: fastmath assumes no infinities
      for s in range(S):
        for g in range(G):
          a = np.float32(0.0)
          for e in range(E):
            a += q_GxE[g, e] * k_SxKxE[s, kv, e]
          p_GxS[g, s] = a
          m_G[g] = max(m_G[g], a)
      for g in range(G):
        z = np.float32(0.0)
        for s in range(S):
          w = np.exp(p_GxS[g, s] - m_G[g])
          p_GxS[g, s] = w
          z += w
        m_G[g] = np.float32(1.0) / z
      for s in range(S):
        for g in range(G):
          w = p_GxS[g, s] * m_G[g]
          for e in range(E):
            acc_GxE[g, e] += w * v_SxKxE[s, kv, e]
      for g in range(G):
        for e in range(E):
          out[t, (kv * G + g) * E + e] = acc_GxE[g, e]
  return out


@_jit
def _layer_py(x_TxD, attn_norm, ffn_norm, qkv, qkv_q4, wo, wo_q4, gu, gu_q4, down, down_q4, F, k_SxKxE,
              v_SxKxE, cos_SxE2, sin_SxE2, pos0, H, K, E, eps):  # pragma: no cover - compiled
  T = x_TxD.shape[0]
  h = _rms_norm(x_TxD, attn_norm, eps)
  qkv_TxC = _planes_matmul(qkv, qkv_q4, h)
  _rope(qkv_TxC, 0, H, E, cos_SxE2, sin_SxE2, pos0)
  _rope(qkv_TxC, H * E, K, E, cos_SxE2, sin_SxE2, pos0)
  for t in range(T):
    for kh in range(K):
      for e in range(E):
        k_SxKxE[pos0 + t, kh, e] = qkv_TxC[t, (H + kh) * E + e]
        v_SxKxE[pos0 + t, kh, e] = qkv_TxC[t, (H + K + kh) * E + e]
  o_TxHE = _attention(qkv_TxC, k_SxKxE, v_SxKxE, pos0, H, K, E)
  y = _planes_matmul(wo, wo_q4, o_TxHE)
  D = x_TxD.shape[1]
  x = np.empty((T, D), np.float32)
  for t in range(T):
    for i in range(D):
      x[t, i] = x_TxD[t, i] + y[t, i]
  h = _rms_norm(x, ffn_norm, eps)
  gu_TxC = _planes_matmul(gu, gu_q4, h)
  a_TxF = np.empty((T, F), np.float32)
  for t in range(T):
    for i in range(F):
      g = gu_TxC[t, i]
      a_TxF[t, i] = g / (np.float32(1.0) + np.exp(-g)) * gu_TxC[t, F + i]
  y = _planes_matmul(down, down_q4, a_TxF)
  for t in range(T):
    for i in range(D):
      x[t, i] += y[t, i]
  return x


@_jit
def _layers_py(x_TxD, attn_norm_LxD, ffn_norm_LxD, qkv_L, qkv_q4, wo_L, wo_q4, gu_L, gu_q4, down_L, down_q4, F,
               k_LxSxKxE, v_LxSxKxE, cos_SxE2, sin_SxE2, pos0, H, K, E, eps):  # pragma: no cover - compiled
  """All L blocks in one call (stacked weights and caches): no Python between layers."""
  for i in range(qkv_L.shape[0]):
    x_TxD = _layer_py(x_TxD, attn_norm_LxD[i], ffn_norm_LxD[i], qkv_L[i], qkv_q4, wo_L[i], wo_q4, gu_L[i],
                      gu_q4, down_L[i], down_q4, F, k_LxSxKxE[i], v_LxSxKxE[i], cos_SxE2, sin_SxE2, pos0, H, K,
                      E, eps)
  return x_TxD
