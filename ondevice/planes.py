"""Q4_0 / Q8_0 weights repacked once at load into SIMD planes, the kernel threads, and the calls that run them.

Layout. 64 output rows form a group; per (group g, block b of 32 inputs) the planes hold the 64 rows' f16
scales (128 B) and their quants (Q4_0: 1024 B, Q8_0: 2048 B) ordered [sub-group s of 16 rows][quad c][row r]
[4 bytes], so that one 64-byte load gives 4 consecutive quants of 16 rows: the operand of one AVX-512 VNNI
``vpdpbusd`` (simd.py). Q4_0 keeps ggml's nibble packing (low nibble = quant j, high = quant j+16); Q8_0 is
stored +128 (unsigned). Same bytes per weight as the file (18 / 34 per 32), the same quantised values, and
llama.cpp's x86 arithmetic (planes_kernels.py), so results equal llama.cpp's bit for bit. Matrices that read
the same input are packed into one ``Planes`` (wq/wk/wv; w_gate/w_up with their row groups interleaved, so that
a thread owning gate group j also owns up group j and applies SwiGLU on the spot).

Threads. ``set_threads(n)``: a decoder step over all bound layers runs as ONE numba call on each of n threads
(``layers``): the kernels split row groups and attention heads between them and synchronise with a spinning
barrier. A ``Team`` of Python threads starts those calls; numba releases the GIL inside them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import threading
import weakref

import numpy as np

from ondevice import planes_kernels as pk
from ondevice.planes_kernels import HAVE_NUMBA, QK, R

PLANE_BYTES = {"Q4_0": 18, "Q8_0": 34}  # per row per block, as in the file
GGML_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}
_GROUP_BLOCK = {"Q4_0": 1024, "Q8_0": 2048}
_threads = 1


def set_threads(n: int) -> None:
  """Threads of every decoder step from now on (1 = serial)."""
  global _threads
  _threads = max(1, int(n))


def get_threads() -> int:
  return _threads


def rms_norm(x_TxD: np.ndarray, w_D: np.ndarray, eps: float) -> np.ndarray:
  """ggml's rms_norm with the weight multiply (see planes_kernels.rms_norm)."""
  x_TxD = np.ascontiguousarray(x_TxD, np.float32)
  out = np.empty_like(x_TxD)
  if HAVE_NUMBA:
    pk.rms_norm(x_TxD, np.ascontiguousarray(w_D, np.float32), np.float32(eps), out)
    return out
  mean = (x_TxD * x_TxD).astype(np.float64).sum(-1, keepdims=True) / x_TxD.shape[-1]
  sc = np.float32(1.0) / np.sqrt(mean.astype(np.float32) + np.float32(eps))
  return (x_TxD * sc) * w_D


def act_q8(x_TxI: np.ndarray) -> tuple:
  """(dequantised activations x' = q * f16(d), per-block sums of x'): ggml's Q8_0 activation quantisation."""
  x_TxI = np.ascontiguousarray(x_TxI, np.float32)
  T, n_in = x_TxI.shape
  xb = x_TxI.reshape(T, -1, QK)
  amax = np.abs(xb).max(-1, keepdims=True)
  inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
  q = np.rint(xb * inv)
  d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
  xq = q * d
  return xq.reshape(T, n_in).astype(np.float32), (q.sum(-1) * d[..., 0]).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Planes:
  """One or more quantised matrices with the same n_in, repacked (module docstring). ``splits`` are the row
  offsets of the members; calling returns one T x n_out_i array per member."""
  qtype: str
  q: np.ndarray  # uint8 (G, B * group-block bytes)
  s: np.ndarray  # uint16 (G, B * 64): f16 scales
  n_in: int
  splits: tuple  # (0, n_out_0, n_out_0 + n_out_1, ...)
  interleaved: bool = False  # two members whose row groups alternate (gate/up)

  @property
  def is_q4(self) -> bool:
    return self.qtype == "Q4_0"

  @property
  def n_groups(self) -> int:
    return self.q.shape[0]

  @property
  def nbytes(self) -> int:
    return self.q.nbytes + self.s.nbytes

  def __call__(self, x_TxI: np.ndarray) -> list:
    out = pk.matmul(self.q, self.s, self.is_q4, self.n_groups, np.ascontiguousarray(x_TxI, np.float32))
    if self.interleaved:
      T = out.shape[0]
      o = out.reshape(T, -1, 2, R)
      n = self.splits[1]
      return [o[:, :, 0].reshape(T, -1)[:, :n], o[:, :, 1].reshape(T, -1)[:, :n]]
    s = self.splits
    return [out[:, s[i]:s[i + 1]] for i in range(len(s) - 1)]


def _pad_rows(blk: np.ndarray) -> np.ndarray:
  G = -(-blk.shape[0] // R)
  if G * R == blk.shape[0]:
    return blk
  return np.concatenate([blk, np.zeros((G * R - blk.shape[0],) + blk.shape[1:], np.uint8)])


def repack(qtype: str, raws: list, n_in: int, interleave: bool = False) -> Planes:
  """Row-major ggml blocks (each uint8 (n_out_i, n_in/32 * block bytes)) -> one Planes over all rows.
  A one-time copy at load into anonymous memory (not the file's pages); no f32 weights are made."""
  if qtype not in PLANE_BYTES or n_in % QK:
    raise NotImplementedError(f"no planes for {qtype} with n_in={n_in}; use kernels.matmul on the mmap view")
  nb = n_in // QK
  rows = [np.asarray(r, np.uint8).reshape(-1, nb, GGML_BLOCK_BYTES[qtype]) for r in raws]
  splits = tuple(np.cumsum([0] + [r.shape[0] for r in rows]).tolist())
  if interleave:
    if len(rows) != 2 or rows[0].shape != rows[1].shape:
      raise ValueError("interleaving needs two matrices of one shape (gate and up)")
    a, b = _pad_rows(rows[0]), _pad_rows(rows[1])
    blk = np.stack([a.reshape(-1, R, nb, a.shape[2]), b.reshape(-1, R, nb, b.shape[2])], 1).reshape(-1, nb, a.shape[2])
  else:
    blk = _pad_rows(np.concatenate(rows) if len(rows) > 1 else rows[0])
  G = blk.shape[0] // R
  s = np.ascontiguousarray(blk[..., :2]).view(np.uint16)[..., 0].reshape(G, R, nb).transpose(0, 2, 1)
  if qtype == "Q4_0":  # [g, s, r, b, c, i] -> [g, b, s, c, r, i]
    q = blk[..., 2:].reshape(G, 4, 16, nb, 4, 4).transpose(0, 3, 1, 4, 2, 5)
  else:
    q = (blk[..., 2:] ^ np.uint8(0x80)).reshape(G, 4, 16, nb, 8, 4).transpose(0, 3, 1, 4, 2, 5)
  return Planes(qtype, np.ascontiguousarray(q).reshape(G, -1), np.ascontiguousarray(s).reshape(G, -1), n_in,
                splits, interleave)


@dataclasses.dataclass(frozen=True)
class Stack:
  """The planes of L consecutive blocks stacked along a leading axis (one array per kind), so that a decoder
  step over all of them is one call per thread (``layers``). The per-layer Planes are views of it."""
  attn_norm_LxD: np.ndarray
  ffn_norm_LxD: np.ndarray
  qkv: tuple  # (q (L, G, ...), s (L, G, ...))
  wo: tuple
  gate_up: tuple
  down: tuple
  is_q4: tuple  # (qkv, wo, gate_up, down)
  d_ff: int

  def slice(self, a: int, b: int) -> "Stack":
    """Layers [a, b) of the stack (views)."""
    return Stack(self.attn_norm_LxD[a:b], self.ffn_norm_LxD[a:b], *(tuple(v[a:b] for v in k) for k in
                 (self.qkv, self.wo, self.gate_up, self.down)), self.is_q4, self.d_ff)


def stack(layer_planes: list, attn_norms: list, ffn_norms: list):
  """[(qkv, wo, gate_up, down) Planes per layer] -> (Stack, the same Planes as views of it), or None when the
  layers' planes differ in type or shape, or gate/up are not interleaved (then each block runs on its own)."""
  kinds = list(zip(*layer_planes))
  if any(len({(p.qtype, p.q.shape, p.splits, p.interleaved) for p in k}) != 1 for k in kinds):
    return None
  if not kinds[2][0].interleaved:
    return None
  arrays = [(np.stack([p.q for p in k]), np.stack([p.s for p in k])) for k in kinds]
  st = Stack(np.stack(attn_norms).astype(np.float32), np.stack(ffn_norms).astype(np.float32), *arrays,
             is_q4=tuple(k[0].is_q4 for k in kinds), d_ff=kinds[2][0].splits[1])
  views = [tuple(dataclasses.replace(p, q=a[0][i], s=a[1][i]) for p, a in zip(lp, arrays))
           for i, lp in enumerate(layer_planes)]
  return st, views


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _publish(ctrl: np.ndarray) -> None:
  """Bump the job counter and wake kernel threads sleeping on it (planes_kernels.wait_change)."""
  ctrl[pk.C_GEN] += 1  # x86 keeps this store after the job's fields
  if ctrl[pk.C_SLEEPERS] > 0:
    from ondevice.simd import FUTEX_WAKE_PRIVATE, SYS_FUTEX
    _libc.syscall(ctypes.c_long(SYS_FUTEX), ctypes.c_void_p(ctrl.ctypes.data + 8 * pk.C_GEN),
                  ctypes.c_int(FUTEX_WAKE_PRIVATE), ctypes.c_int(1 << 30), None, None, ctypes.c_int(0))


def _stop(ctrl: np.ndarray, threads: list = ()) -> None:
  ctrl[pk.C_STOP] = 1
  _publish(ctrl)
  for t in threads:
    t.join(timeout=1.0)


class Team:
  """The kernel threads of one Stack: n-1 helper threads that live inside ``planes_kernels.worker`` (no GIL,
  no Python between calls: they poll a control block, then nap) and the caller as thread 0. ``run`` publishes
  a job (the per-call arrays as addresses) and runs the caller's share; the step's barriers do the rest."""

  def __init__(self, st: "Stack", n: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, cos, sin):
    self.st, self.n = st, n
    self.dims = (n_heads, n_kv_heads, head_dim, st.d_ff, np.float32(eps))
    self.sync = np.zeros(32, np.int64)
    self.ctrl = np.zeros(32, np.int64)
    q = st.is_q4
    self._persist = (st.attn_norm_LxD, st.ffn_norm_LxD, st.qkv[0], st.qkv[1], q[0], st.wo[0], st.wo[1], q[1],
                     st.gate_up[0], st.gate_up[1], q[2], st.down[0], st.down[1], q[3], cos, sin) + self.dims
    threads = [threading.Thread(target=pk.worker, args=(tid, n, self.sync, self.ctrl, 0) + self._persist, daemon=True,
                                name=f"ondevice-kernel-{tid}") for tid in range(1, n)]
    for t in threads:
      t.start()
    # Stopped when the team goes away or at interpreter exit (before the arrays they read are torn down).
    self._finalizer = weakref.finalize(self, _stop, self.ctrl, threads)

  def run(self, l0: int, l1: int, x, k_LxSxKxE, v_LxSxKxE, pos0: int, tiny: bool) -> np.ndarray:
    st, (H, K, E, F, eps) = self.st, self.dims
    T = x.shape[0]
    bufs = (np.empty((T, st.qkv[0].shape[1] * R), np.float32), np.empty((T, H * E), np.float32),
            np.empty((T, st.wo[0].shape[1] * R), np.float32),
            np.empty((T, st.gate_up[0].shape[1] * R // 2), np.float32))
    out = np.empty_like(x)
    if self.n > 1:
      c = self.ctrl
      for i, v in ((pk.C_T, T), (pk.C_POS, pos0), (pk.C_TINY, int(tiny)), (pk.C_L0, l0), (pk.C_L1, l1),
                   (pk.C_S, k_LxSxKxE.shape[1])):
        c[i] = v
      for i, a in zip((pk.C_X, pk.C_OUT, pk.C_K, pk.C_V, pk.C_QKV, pk.C_ATT, pk.C_Y, pk.C_A),
                      (x, out, k_LxSxKxE, v_LxSxKxE) + bufs):
        c[i] = a.ctypes.data
      _publish(c)
    p = self._persist
    pk.step(0, self.n, self.sync, x, out, p[0][l0:l1], p[1][l0:l1], p[2][l0:l1], p[3][l0:l1], p[4], p[5][l0:l1],
            p[6][l0:l1], p[7], p[8][l0:l1], p[9][l0:l1], p[10], p[11][l0:l1], p[12][l0:l1], p[13], k_LxSxKxE,
            v_LxSxKxE, p[14], p[15], pos0, H, K, E, F, eps, tiny, *bufs)
    return out

  def close(self) -> None:
    self._finalizer()


def layers(team: Team, l0: int, l1: int, x_TxD, k_LxSxKxE, v_LxSxKxE, pos0: int,
           batch_invariant: bool = False) -> np.ndarray:
  """Blocks [l0, l1) of the team's stack for T tokens; writes K/V rows pos0.. into the given caches (their
  L axis = those blocks). With T >= 2 the KV product follows llama.cpp's batched order unless
  ``batch_invariant`` (then each token's result equals what a one-token pass gives: speculative
  verification relies on it)."""
  x = np.ascontiguousarray(x_TxD, np.float32)
  return team.run(l0, l1, x, k_LxSxKxE, v_LxSxKxE, pos0, x.shape[0] >= 2 and not batch_invariant)


def rope_tables(max_len: int, head_dim: int, theta: float) -> tuple:
  """(cos, sin) [max_len, head_dim/2] as ggml builds them: theta_i = pos * s^i by repeated float32
  multiplication with s = powf(theta, -2/head_dim), then libm's cosf / sinf (glibc; numpy's float32 cos differs
  in the last bit for some arguments, which changes llama.cpp-exact results)."""
  libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
  for f in ("powf", "cosf", "sinf"):
    getattr(libm, f).restype = ctypes.c_float
  libm.powf.argtypes = (ctypes.c_float, ctypes.c_float)
  libm.cosf.argtypes = libm.sinf.argtypes = (ctypes.c_float,)
  s = np.float32(libm.powf(np.float32(theta), np.float32(-2.0 / head_dim)))
  th = np.empty((max_len, head_dim // 2), np.float32)
  col = np.arange(max_len, dtype=np.float32)
  for i in range(head_dim // 2):
    th[:, i] = col
    col = (col * s).astype(np.float32)
  flat = th.ravel()
  cos = np.fromiter((libm.cosf(v) for v in flat.tolist()), np.float32, flat.size).reshape(th.shape)
  sin = np.fromiter((libm.sinf(v) for v in flat.tolist()), np.float32, flat.size).reshape(th.shape)
  return cos, sin


def inspect_asm(qtype: str = "Q4_0") -> str:
  """Assembly of a freshly compiled planes mat-vec (numba cannot show cached code): look for vpdpbusd."""
  import gguf
  import numba
  w = np.random.default_rng(0).normal(size=(R, 64)).astype(np.float32)
  p = repack(qtype, [gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))], 64)
  f = numba.njit(pk.matmul.py_func)
  f(p.q, p.s, p.is_q4, p.n_groups, np.ones((1, 64), np.float32))
  return "\n".join(f.inspect_asm().values())
