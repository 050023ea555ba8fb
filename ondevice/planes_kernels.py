"""The compiled numba code behind ``ondevice/planes.py``: ggml's arithmetic, bit for bit, in a fused decoder step.

Weights arrive in the planes layout (planes.py): 64 output rows per group, per block the rows' f16 scales and
their quants arranged so that one AVX-512 register holds 4 consecutive quants of 16 rows (``simd.q4_rows64``).
Every floating-point operation follows what llama.cpp's CPU backend does on x86 (ggml-cpu, AVX-512 build),
in the same order, so our logits equal llama.cpp's exactly (f32 KV cache, flash attention off; tests):
* activations quantised to Q8_0 (d = amax/127 stored as f16, q = round-half-even(x*127/amax));
* Q4_0 / Q8_0 mat-vecs: integer block dots, then fma(float(isum), d_w*d_x, acc) block by block (Q4_0: one
  accumulator per row, as the repacked gemv/gemm; Q8_0: eight lane accumulators and hsum_float_8, as vec_dot);
* RMSNorm: float squares summed in double, mean and 1/sqrt in float, (x*scale)*w;
* RoPE (NORM): cos/sin tables of theta_i = pos*s^i built by repeated float multiplication, libm cosf/sinf
  (planes.rope_tables), rotation by fma(x0, c, -(x1*s)) and fma(x0, s, x1*c);
* KQ: ggml_vec_dot_f32's order (four 16-lane fma accumulators over 64-element steps, pairwise adds, the 16-lane
  tree sum of _mm512_reduce_add_ps, fma leftovers); softmax: kq*scale, max, ggml_v_expf in 16-wide chunks
  summed in double, times float(1/sum); KQV: tinyBLAS's 16-lane fma accumulation when the pass has >= 2
  tokens (llama.cpp hands those to llamafile_sgemm), ggml_vec_dot_f32's order for one token;
* SwiGLU: x / (1 + ggml_v_expf(-x)) * up.
A decoder step over all bound layers is ONE call per thread (``step``): threads split each matrix's row
groups and the attention's KV heads and meet at a spinning barrier (5 per layer); each keeps its own copy of
the residual stream, so norms and activation quantisation need no barrier.

Why one file: numba caches compiled code per file and does not notice when a jitted function that another
one calls changes in a different file. So every jitted function that calls another lives here; the
intrinsics live in ``simd.py``, and this module clears its own numba cache when simd.py's source changes.
"""
from __future__ import annotations

import numpy as np

from ondevice import matvec, nbcache, simd, simd_k
from ondevice.simd import HAVE_NUMBA

if HAVE_NUMBA:
  import numba
  from ondevice.matvec import act_bf16, act_f16, act_q8k, mat_groups
  from ondevice.simd import (atomic_add, atomic_load, cpu_relax, f32_ptr, fma32, futex_wait, futex_wake, round_f16,
                             vaxpy, vdot_f32, vexp_sum, vswiglu)

QK = 32
R = 64  # rows per plane group
SPIN_BEFORE_SLEEP = 4000  # ~0.1 ms of `pause` spinning, then the waiter sleeps in the kernel (futex) until woken


def _anchor():  # numba's cache locators start from a function of this file
  pass


nbcache.prefer_512_bit_vectors()
nbcache.clear_stale(__file__, [simd.__file__, simd_k.__file__, matvec.__file__], _anchor)


def _jit(f=None, nogil=False):
  # Exact IEEE everywhere (no fastmath): reassociation or contraction would change the roundings above.
  if f is None:
    return lambda g: _jit(g, nogil)
  return numba.njit(fastmath=False, cache=True, nogil=nogil)(f) if HAVE_NUMBA else f


# ------------------------------------------------------------------------------------------ pieces

@_jit
def act_q8(x_TxI, xq_TxI, xd_TxB, xs4_TxB, xs8_TxB8):  # pragma: no cover - compiled
  """ggml's x86 quantize_row_q8_0: d = amax/127 -> f16, q = rint(x * 127/amax). Also the corrections the
  kernels subtract: 8*sum(q) per block (Q4_0's -8 offset) and 128*sum per quad (Q8_0 stored +128)."""
  T, n_in = x_TxI.shape
  for t in range(T):
    for b in range(n_in // 32):
      amax = np.float32(0.0)
      for j in range(32):
        amax = max(amax, abs(x_TxI[t, b * 32 + j]))
      inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
      xd_TxB[t, b] = round_f16(amax / np.float32(127.0))
      s = 0
      for c in range(8):
        sc = 0
        for i in range(4):
          q = np.int32(np.rint(x_TxI[t, b * 32 + 4 * c + i] * inv))
          xq_TxI[t, b * 32 + 4 * c + i] = q
          sc += q
        xs8_TxB8[t, b * 8 + c] = 128 * sc
        s += sc
      xs4_TxB[t, b] = 8 * s


@_jit
def rms_norm(x_TxD, w_D, eps, out_TxD):  # pragma: no cover - compiled
  """ggml's rms_norm (+ the weight multiply it fuses): double sum of float squares, float mean and scale."""
  T, D = x_TxD.shape
  for t in range(T):
    ss = 0.0
    for i in range(D):
      ss += np.float64(x_TxD[t, i] * x_TxD[t, i])
    mean = np.float32(ss / D)
    sc = np.float32(1.0) / np.sqrt(mean + eps)
    for i in range(D):
      out_TxD[t, i] = (x_TxD[t, i] * sc) * w_D[i]


_H = {k: np.float32(float.fromhex(v)) for k, v in dict(
    shift="0x1.8p23", log2e="0x1.715476p+0", ln2_hi="0x1.62e4p-1", ln2_lo="0x1.7f7d1cp-20", c5="0x1.0e4020p-7",
    c4="0x1.573e2ep-5", c3="0x1.555e66p-3", c2="0x1.fffdb6p-2", c1="0x1.ffffecp-1").items()}
_SHIFT, _LOG2E, _LN2_HI, _LN2_LO = _H["shift"], _H["log2e"], _H["ln2_hi"], _H["ln2_lo"]
_C5, _C4, _C3, _C2, _C1 = _H["c5"], _H["c4"], _H["c3"], _H["c2"], _H["c1"]


@_jit
def expf_ggml(x):  # pragma: no cover - compiled
  """ggml_v_expf (AVX-512), one lane: n = round(x/ln2) by the 1.5*2^23 shift, b = x - n*ln2 in two fmas,
  a degree-5 polynomial in b, times 2^n (scalef: exact product, one rounding); |n| > 192 -> 0 or inf."""
  z = fma32(x, _LOG2E, _SHIFT)
  n = z - _SHIFT
  b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
  if abs(n) > np.float32(192.0):
    return np.float32(0.0) if n <= np.float32(0.0) else np.float32(np.inf)
  u = b * b
  j = fma32(fma32(fma32(_C5, b, _C4), u, fma32(_C3, b, _C2)), u, fma32(_C1, b, np.float32(1.0)))
  return np.float32(np.float64(j) * (2.0 ** np.float64(n)))


@_jit
def rope(buf, col0, n_heads, E, cos_row, sin_row):  # pragma: no cover - compiled
  """In place: llama.cpp NORM RoPE on n_heads heads of E starting at column col0 (adjacent pairs). GCC vectorised
  ggml's rotate_pairs 4 pairs at a time with fused multiply-adds; the last E/2 % 4 pairs are not fused."""
  v = (E // 2) // 4 * 4
  for h in range(n_heads):
    c0 = col0 + h * E
    for i in range(E // 2):
      x0, x1 = buf[c0 + 2 * i], buf[c0 + 2 * i + 1]
      c, s = cos_row[i], sin_row[i]
      if i < v:
        buf[c0 + 2 * i] = fma32(x0, c, -(x1 * s))
        buf[c0 + 2 * i + 1] = fma32(x0, s, x1 * c)
      else:
        buf[c0 + 2 * i] = x0 * c - x1 * s
        buf[c0 + 2 * i + 1] = x0 * s + x1 * c


@_jit
def attend(q, qo, kc_SxKxE, vc_SxKxE, kh, S, scale, tiny, out, oo, p, acc):  # pragma: no cover - compiled
  """One query head (q[qo:qo+E]) over cache rows < S of KV head kh -> out[oo:oo+E]: KQ, softmax, KQV in
  llama.cpp's order (module docstring). Scratch: p (>= S + 16), acc (>= 64 E)."""
  K, E = kc_SxKxE.shape[1], kc_SxKxE.shape[2]
  mx = np.float32(-np.inf)
  for s in range(S):
    w = vdot_f32(q, qo, kc_SxKxE, (s * K + kh) * E, E) * scale
    p[s] = w
    mx = max(mx, w)
  n16 = (S + 15) // 16
  for s in range(S, 16 * n16):
    p[s] = np.float32(-np.inf)
  inv = np.float32(1.0 / vexp_sum(p, mx, n16))
  for s in range(S):
    p[s] = p[s] * inv
  acc[:64 * E] = 0.0
  vec = E % 16 == 0
  for s in range(S):
    lane = s % 16 if tiny else ((s % 64) // 16) * 16 + s % 16  # tinyBLAS: s mod 16; vec_dot: 4 x 16 lanes
    if vec:
      vaxpy(acc, lane * E, p[s], vc_SxKxE, (s * K + kh) * E, E // 16)
    else:
      for e in range(E):
        acc[lane * E + e] = fma32(p[s], vc_SxKxE[s, kh, e], acc[lane * E + e])
  if not tiny:
    for l in range(16):
      for e in range(E):
        acc[l * E + e] = (acc[l * E + e] + acc[(32 + l) * E + e]) + (acc[(16 + l) * E + e] + acc[(48 + l) * E + e])
  for e in range(E):  # the 16-lane tree sum, lanes = acc rows 0..15
    a0 = (acc[8 * E + e] + acc[e]) + (acc[12 * E + e] + acc[4 * E + e])
    a1 = (acc[9 * E + e] + acc[E + e]) + (acc[13 * E + e] + acc[5 * E + e])
    a2 = (acc[10 * E + e] + acc[2 * E + e]) + (acc[14 * E + e] + acc[6 * E + e])
    a3 = (acc[11 * E + e] + acc[3 * E + e]) + (acc[15 * E + e] + acc[7 * E + e])
    out[oo + e] = (a0 + a2) + (a1 + a3)


@_jit
def wait_change(word, idx, old, sleepers):  # pragma: no cover - compiled
  """Until int64 word[idx] != old: spin with `pause` (partners that are merely late arrive within it), then sleep
  in the kernel (futex), counted in word[sleepers] so that the waker knows to wake. On a shared machine a peer
  may be descheduled for milliseconds: spinning (or yielding) through that costs far more than sleeping."""
  spins = 0
  while atomic_load(word, idx) == old:
    cpu_relax()
    spins += 1
    if spins > SPIN_BEFORE_SLEEP:
      atomic_add(word, sleepers, 1)
      if atomic_load(word, idx) == old:  # seq_cst: a waker that bumped idx before our increment is seen here
        futex_wait(word, idx, old & 0xFFFFFFFF)
      atomic_add(word, sleepers, -1)


@_jit
def barrier(sync, nth):  # pragma: no cover - compiled
  """All nth threads meet here. sync: int64[32]: count at 0, generation at 16, sleepers at 24 (own lines)."""
  if nth == 1:
    return
  gen = atomic_load(sync, 16)
  if atomic_add(sync, 0, 1) == nth - 1:
    atomic_add(sync, 0, -nth)
    atomic_add(sync, 16, 1)
    if atomic_load(sync, 24) > 0:
      futex_wake(sync, 16, nth)
  else:
    wait_change(sync, 16, gen, 24)


@_jit
def _share(n, tid, nth):  # pragma: no cover - compiled
  return n * tid // nth, n * (tid + 1) // nth


@_jit
def rms_norm_row(x, o, n, w, eps):  # pragma: no cover - compiled
  """In place: ggml_rms_norm then ggml_mul on x[o:o+n] (per-head q/k norm of Qwen3)."""
  ss = 0.0
  for i in range(n):
    ss += np.float64(x[o + i] * x[o + i])
  sc = np.float32(1.0) / np.sqrt(np.float32(ss / n) + eps)
  for i in range(n):
    x[o + i] = (x[o + i] * sc) * w[i]


@_jit
def rope_neox(buf, col0, n_heads, E, cos_row, sin_row):  # pragma: no cover - compiled
  """In place: llama.cpp NEOX RoPE (pairs i, i + E/2) on n_heads heads of E starting at column col0."""
  h2 = E // 2
  for h in range(n_heads):
    c0 = col0 + h * E
    for i in range(h2):
      x0, x1 = buf[c0 + i], buf[c0 + i + h2]
      c, s = cos_row[i], sin_row[i]
      buf[c0 + i] = fma32(x0, c, -(x1 * s))
      buf[c0 + i + h2] = fma32(x0, s, x1 * c)


@_jit
def prep(h, n, mask, xq, xd, xs4, xs8, kq, kd, kbs, xh, xb):  # pragma: no cover - compiled
  """The activation formats (matvec.NEED_* bits in ``mask``) of h[:, :n] that the next matrices read."""
  if mask & 1:
    act_q8(h[:, :n], xq[:, :n], xd[:, :n // 32], xs4[:, :n // 32], xs8[:, :n // 4])
  if mask & 2:
    act_q8k(h[:, :n], kq[:, :n], kd[:, :n // 256], kbs[:, :n // 16])
  if mask & 4:
    act_f16(h[:, :n], xh[:, :n])
  if mask & 8:
    act_bf16(h[:, :n], xb[:, :n])


@_jit
def _mask(d):  # pragma: no cover - compiled
  c = d[0]
  return 1 if c <= 1 else 2 if c <= 4 else 4 if c == 5 else 8 if c == 6 else 0


@_jit
def _mm(d, W, S, S16, g0, g1, h, n, xq, xd, xs4, xs8, kq, kd, kbs, xh, xb, out, col0, gbase,
        batched):  # pragma: no cover - compiled
  mat_groups(d, W, S, S16, g0, g1, h[:, :n], xq[:, :n].view(np.int32), xd[:, :n // 32], xs4[:, :n // 32],
             xs8[:, :n // 4], kq[:, :n], kd[:, :n // 256], kbs[:, :n // 16], xh[:, :n], xb[:, :n], out, col0, gbase,
             batched)


@_jit(nogil=True)
def matmul_desc(d, W, S, x_TxI, batched):  # pragma: no cover - compiled
  """One matrix (a desc row) times T activations, single-threaded: T x (64 * groups), padded rows included."""
  T, n = x_TxI.shape
  xq = np.empty((T, n), np.int8)
  xd = np.empty((T, n // 32), np.float32)
  xs4 = np.empty((T, n // 32), np.int32)
  xs8 = np.empty((T, n // 4), np.int32)
  kq = np.empty((T, n), np.int8)
  kd = np.empty((T, max(1, n // 256)), np.float32)
  kbs = np.empty((T, n // 16), np.int32)
  xh = np.empty((T, n), np.float32)
  xb = np.empty((T, n), np.float32)
  prep(x_TxI, n, _mask(d), xq, xd, xs4, xs8, kq, kd, kbs, xh, xb)
  out = np.zeros((T, d[3] * 64), np.float32)
  _mm(d, W, S, S.view(np.uint16), 0, d[3], x_TxI, n, xq, xd, xs4, xs8, kq, kd, kbs, xh, xb, out, 0, 0, batched)
  return out


# Per-layer vectors (offsets into V, -1 when absent) and flags.
V_ATTN_NORM, V_FFN_NORM, V_BQ, V_BK, V_BV, V_QNORM, V_KNORM = range(7)
S_Q, S_K, S_V, S_O, S_GATE, S_UP, S_DOWN = range(7)


@_jit(nogil=True)
def step(tid, nth, sync, x_TxD, out_TxD, desc, W, S, V, vd, k_LxSxKxE, v_LxSxKxE, cos_SxE2, sin_SxE2, pos0, H, K, E,
         F, eps, neox, tiny, cut, qkv_buf, att_buf, y_buf, a_buf):  # pragma: no cover - compiled
  """All layers of ``desc`` (L x 7 matrices, ``S_*``) for T tokens at positions pos0.., as thread tid of nth (every
  thread calls this with the same arguments). Writes K/V rows pos0.. of every layer; thread 0 writes the result
  to out_TxD. ``tiny``: the pass is batched (T >= 2, not batch-invariant): llama.cpp's batched orders. ``cut``:
  the layer (index into desc, -1: none) after whose attention llama.cpp keeps only the rows whose logits are
  wanted (the model's last layer when only the last token's logits are): its feed-forward block then runs
  each row as a one-token pass, which is what the last row gets in llama.cpp."""
  T, D = x_TxD.shape
  L = desc.shape[0]
  G = H // K
  S16 = S.view(np.uint16)
  cq, ck = 0, ((H * E + 63) // 64) * 64
  cv = ck + ((K * E + 63) // 64) * 64
  x = x_TxD.copy()
  h = np.empty((T, D), np.float32)
  nmax = max(D, H * E, F)
  xq = np.empty((T, nmax), np.int8)
  xd = np.empty((T, nmax // 32), np.float32)
  xs4 = np.empty((T, nmax // 32), np.int32)
  xs8 = np.empty((T, nmax // 4), np.int32)
  kq = np.empty((T, nmax), np.int8)
  kd = np.empty((T, max(1, nmax // 256)), np.float32)
  kbs = np.empty((T, nmax // 16), np.int32)
  xh = np.empty((T, nmax), np.float32)
  xb = np.empty((T, nmax), np.float32)
  gu_tmp = np.empty((T, 128), np.float32)
  S_max = k_LxSxKxE.shape[1]
  p = np.empty(S_max + 16, np.float32)
  acc = np.empty(64 * E, np.float32)
  scale = np.float32(1.0) / np.sqrt(np.float32(E))
  for l in range(L):
    dl = desc[l]
    # attention block
    rms_norm(x, V[vd[l, V_ATTN_NORM]:vd[l, V_ATTN_NORM] + D], eps, h)
    prep(h, D, _mask(dl[S_Q]) | _mask(dl[S_K]) | _mask(dl[S_V]), xq, xd, xs4, xs8, kq, kd, kbs, xh, xb)
    for sl, c0 in ((S_Q, cq), (S_K, ck), (S_V, cv)):
      g0, g1 = _share(dl[sl, 3], tid, nth)
      _mm(dl[sl], W, S, S16, g0, g1, h, D, xq, xd, xs4, xs8, kq, kd, kbs, xh, xb, qkv_buf, c0, 0, tiny)
    barrier(sync, nth)
    for kh in range(tid, K, nth):
      for t in range(T):
        pos = pos0 + t
        row = qkv_buf[t]
        for hh in range(kh * G, kh * G + G):
          if vd[l, V_BQ] >= 0:
            for e in range(E):
              row[cq + hh * E + e] = row[cq + hh * E + e] + V[vd[l, V_BQ] + hh * E + e]
          if vd[l, V_QNORM] >= 0:
            rms_norm_row(row, cq + hh * E, E, V[vd[l, V_QNORM]:vd[l, V_QNORM] + E], eps)
        if vd[l, V_BK] >= 0:
          for e in range(E):
            row[ck + kh * E + e] = row[ck + kh * E + e] + V[vd[l, V_BK] + kh * E + e]
        if vd[l, V_KNORM] >= 0:
          rms_norm_row(row, ck + kh * E, E, V[vd[l, V_KNORM]:vd[l, V_KNORM] + E], eps)
        if vd[l, V_BV] >= 0:
          for e in range(E):
            row[cv + kh * E + e] = row[cv + kh * E + e] + V[vd[l, V_BV] + kh * E + e]
        if neox:
          rope_neox(row, cq + kh * G * E, G, E, cos_SxE2[pos], sin_SxE2[pos])
          rope_neox(row, ck + kh * E, 1, E, cos_SxE2[pos], sin_SxE2[pos])
        else:
          rope(row, cq + kh * G * E, G, E, cos_SxE2[pos], sin_SxE2[pos])
          rope(row, ck + kh * E, 1, E, cos_SxE2[pos], sin_SxE2[pos])
        for e in range(E):
          k_LxSxKxE[l, pos, kh, e] = row[ck + kh * E + e]
          v_LxSxKxE[l, pos, kh, e] = row[cv + kh * E + e]
      for t in range(T):
        for g in range(G):
          hh = kh * G + g
          attend(qkv_buf[t], cq + hh * E, k_LxSxKxE[l], v_LxSxKxE[l], kh, pos0 + t + 1, scale, tiny, att_buf[t],
                 hh * E, p, acc)
    barrier(sync, nth)
    prep(att_buf, H * E, _mask(dl[S_O]), xq, xd, xs4, xs8, kq, kd, kbs, xh, xb)
    g0, g1 = _share(dl[S_O, 3], tid, nth)
    _mm(dl[S_O], W, S, S16, g0, g1, att_buf, H * E, xq, xd, xs4, xs8, kq, kd, kbs, xh, xb, y_buf, 0, 0, tiny)
    barrier(sync, nth)
    for t in range(T):
      for i in range(D):
        x[t, i] = y_buf[t, i] + x[t, i]
    # feed-forward block: a thread owning gate group j also computes up group j and applies SwiGLU on the spot
    tf = tiny and l != cut
    rms_norm(x, V[vd[l, V_FFN_NORM]:vd[l, V_FFN_NORM] + D], eps, h)
    prep(h, D, _mask(dl[S_GATE]) | _mask(dl[S_UP]), xq, xd, xs4, xs8, kq, kd, kbs, xh, xb)
    j0, j1 = _share(dl[S_GATE, 3], tid, nth)
    for j in range(j0, j1):
      _mm(dl[S_GATE], W, S, S16, j, j + 1, h, D, xq, xd, xs4, xs8, kq, kd, kbs, xh, xb, gu_tmp, 0, j, tf)
      _mm(dl[S_UP], W, S, S16, j, j + 1, h, D, xq, xd, xs4, xs8, kq, kd, kbs, xh, xb, gu_tmp, 64, j, tf)
      for t in range(T):
        vswiglu(gu_tmp[t], 0, gu_tmp[t], 64, a_buf[t], 64 * j, 4)
    barrier(sync, nth)
    prep(a_buf, F, _mask(dl[S_DOWN]), xq, xd, xs4, xs8, kq, kd, kbs, xh, xb)
    g0, g1 = _share(dl[S_DOWN, 3], tid, nth)
    _mm(dl[S_DOWN], W, S, S16, g0, g1, a_buf, F, xq, xd, xs4, xs8, kq, kd, kbs, xh, xb, y_buf, 0, 0, tf)
    barrier(sync, nth)
    for t in range(T):
      for i in range(D):
        x[t, i] = y_buf[t, i] + x[t, i]
  if tid == 0:
    out_TxD[:, :] = x


# Control block shared by the caller and the kernel threads of a planes.Team (int64; gen alone on its line).
C_GEN, C_STOP, C_T, C_POS, C_TINY, C_L0, C_L1, C_S, C_X, C_OUT, C_K, C_V, C_QKV, C_ATT, C_Y, C_A = (
    0, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22)
C_SLEEPERS, C_CUT = 24, 23


@_jit(nogil=True)
def worker(tid, nth, sync, ctrl, seen, desc, W, S, V, vd, cos_SxE2, sin_SxE2, H, K, E, F, eps,
           neox):  # pragma: no cover - compiled
  """A kernel thread's life: wait for the next job in ``ctrl`` (spin, then sleep), run ``step`` on it as thread
  ``tid``, until ctrl[C_STOP]. The per-call arrays travel as addresses the caller keeps alive. ``seen``: the
  job counter when the team was made (a job published while this thread was still starting is not missed)."""
  D = desc[0, S_O, 4]
  cq = ((H * E + 63) // 64) * 64 + 2 * ((K * E + 63) // 64) * 64
  cy = ((D + 63) // 64) * 64
  ca = ((F + 63) // 64) * 64
  while True:
    wait_change(ctrl, C_GEN, seen, C_SLEEPERS)
    seen = atomic_load(ctrl, C_GEN)
    if ctrl[C_STOP]:
      return
    T, pos0, l0, l1, Sl = ctrl[C_T], ctrl[C_POS], ctrl[C_L0], ctrl[C_L1], ctrl[C_S]
    L = l1 - l0
    x = numba.carray(f32_ptr(ctrl[C_X]), (T, D))
    out = numba.carray(f32_ptr(ctrl[C_OUT]), (T, D))
    kc = numba.carray(f32_ptr(ctrl[C_K]), (L, Sl, K, E))
    vc = numba.carray(f32_ptr(ctrl[C_V]), (L, Sl, K, E))
    step(tid, nth, sync, x, out, desc[l0:l1], W, S, V, vd[l0:l1], kc, vc, cos_SxE2, sin_SxE2, pos0, H, K, E, F, eps,
         neox, ctrl[C_TINY] != 0, ctrl[C_CUT], numba.carray(f32_ptr(ctrl[C_QKV]), (T, cq)),
         numba.carray(f32_ptr(ctrl[C_ATT]), (T, H * E)), numba.carray(f32_ptr(ctrl[C_Y]), (T, cy)),
         numba.carray(f32_ptr(ctrl[C_A]), (T, ca)))
