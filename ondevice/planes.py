"""Weights repacked once at load into SIMD planes, the kernel threads, and the calls that run them.

Layout. 64 output rows form a group. Q4_0 / Q8_0: per (group g, block b of 32 inputs) the planes hold the 64
rows' f16 scales (128 B) and their quants (Q4_0: 1024 B, Q8_0: 2048 B) ordered [sub-group s of 16 rows][quad c]
[row r][4 bytes], so that one 64-byte load gives 4 consecutive quants of 16 rows: the operand of one AVX-512 VNNI
``vpdpbusd`` (simd.py). Q4_0 keeps ggml's nibble packing (low nibble = quant j, high = quant j+16); Q8_0 is
stored +128 (unsigned). Same bytes per weight as the file (18 / 34 per 32). K-quants (Q4_K, Q5_K, Q6_K): the same
idea per super-block of 256 (``kquants.py``). F16 / BF16 / F32 matrices stay row-major. Each matrix is a row of a
``desc`` table (``matvec.DESC_*``: type, offsets into the buffers W (quants) and S (scales), groups, rows,
inputs), so every matrix of a layer may have its own type (llama.cpp's Q4_K_M mixes Q4_K and Q6_K).

``Pack``: all bound layers' matrices in one W / S pair, ``desc`` (L x 7: q, k, v, o, gate, up, down), and the
per-layer vectors (norms, q/k/v biases, q/k norms) in V with offsets ``vd`` (-1 when absent).

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

from ondevice import kquants, matvec
from ondevice import planes_kernels as pk
from ondevice.planes_kernels import HAVE_NUMBA, QK, R

PLANE_BYTES = {"Q4_0": 18, "Q8_0": 34}  # per row per block, as in the file
GGML_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}
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


# ------------------------------------------------------------------------------------------ one matrix

def _pad_rows(blk: np.ndarray) -> np.ndarray:
  G = -(-blk.shape[0] // R)
  if G * R == blk.shape[0]:
    return blk
  return np.concatenate([blk, np.zeros((G * R - blk.shape[0],) + blk.shape[1:], np.uint8)])


def _repack_q0(qtype: str, raw: np.ndarray, n_in: int) -> tuple:
  """Q4_0 / Q8_0 rows -> (quants uint8 (G, B * group-block bytes), f16 scales uint16 (G, B * 64))."""
  nb = n_in // QK
  blk = _pad_rows(np.asarray(raw, np.uint8).reshape(-1, nb, GGML_BLOCK_BYTES[qtype]))
  G = blk.shape[0] // R
  s = np.ascontiguousarray(blk[..., :2]).view(np.uint16)[..., 0].reshape(G, R, nb).transpose(0, 2, 1)
  if qtype == "Q4_0":  # [g, s, r, b, c, i] -> [g, b, s, c, r, i]
    q = blk[..., 2:].reshape(G, 4, 16, nb, 4, 4).transpose(0, 3, 1, 4, 2, 5)
  else:
    q = (blk[..., 2:] ^ np.uint8(0x80)).reshape(G, 4, 16, nb, 8, 4).transpose(0, 3, 1, 4, 2, 5)
  return np.ascontiguousarray(q).reshape(G, -1), np.ascontiguousarray(s).reshape(G, -1)


def pack_matrix(qtype: str, raw: np.ndarray, n_out: int, n_in: int) -> tuple:
  """A file tensor (its bytes, rows x row bytes or rows x n_in) -> (type code, quant bytes, scale bytes, groups)."""
  if qtype in ("Q4_0", "Q8_0"):
    q, s = _repack_q0(qtype, raw, n_in)
    return matvec.CODES[qtype], q.ravel(), s.ravel().view(np.uint8), q.shape[0]
  if qtype in kquants.BLOCK_BYTES:
    q, s = kquants.repack(qtype, raw, n_in)
    return matvec.CODES[qtype], q.ravel(), s.ravel(), q.shape[0]
  if qtype in ("F16", "BF16", "F32"):
    return matvec.CODES[qtype], np.ascontiguousarray(raw).view(np.uint8).ravel(), np.zeros(0, np.uint8), -(-n_out // R)
  raise NotImplementedError(f"no planes for {qtype}")


class _Buf:
  """Grows a uint8 buffer of 64-byte aligned pieces; ``add`` returns a piece's offset."""

  def __init__(self):
    self.parts, self.n = [], 0

  def add(self, b: np.ndarray) -> int:
    off = self.n
    pad = (-b.nbytes) % 64
    self.parts += [b, np.zeros(pad, np.uint8)] if pad else [b]
    self.n += b.nbytes + pad
    return off

  def array(self) -> np.ndarray:
    return np.concatenate(self.parts + [np.zeros(64, np.uint8)]) if self.parts else np.zeros(64, np.uint8)


def _desc_row(W: _Buf, S: _Buf, qtype: str, raw, n_out: int, n_in: int) -> list:
  code, q, s, G = pack_matrix(qtype, raw, n_out, n_in)
  return [code, W.add(q), S.add(s), G, n_out, n_in]


@dataclasses.dataclass(frozen=True)
class Planes:
  """One or more Q4_0 / Q8_0 matrices with the same n_in, packed as one (module docstring). ``splits`` are the
  row offsets of the members; calling returns one T x n_out_i array per member."""
  qtype: str
  q: np.ndarray  # uint8 (G, B * group-block bytes)
  s: np.ndarray  # uint16 (G, B * 64): f16 scales
  n_in: int
  splits: tuple  # (0, n_out_0, n_out_0 + n_out_1, ...)

  @property
  def n_groups(self) -> int:
    return self.q.shape[0]

  @property
  def nbytes(self) -> int:
    return self.q.nbytes + self.s.nbytes

  def __call__(self, x_TxI: np.ndarray, batched: bool = True) -> list:
    d = np.array([matvec.CODES[self.qtype], 0, 0, self.n_groups, self.splits[-1], self.n_in], np.int64)
    out = pk.matmul_desc(d, self.q.ravel(), self.s.ravel().view(np.uint8), np.ascontiguousarray(x_TxI, np.float32),
                         batched)
    s = self.splits
    return [out[:, s[i]:s[i + 1]] for i in range(len(s) - 1)]


def repack(qtype: str, raws: list, n_in: int) -> Planes:
  """Row-major ggml Q4_0 / Q8_0 blocks (each uint8 (n_out_i, n_in/32 * block bytes)) -> one Planes over all rows."""
  if qtype not in PLANE_BYTES or n_in % QK:
    raise NotImplementedError(f"no planes for {qtype} with n_in={n_in}; use kernels.matmul on the mmap view")
  nb = n_in // QK
  rows = [np.asarray(r, np.uint8).reshape(-1, nb * GGML_BLOCK_BYTES[qtype]) for r in raws]
  splits = tuple(np.cumsum([0] + [r.shape[0] for r in rows]).tolist())
  q, s = _repack_q0(qtype, np.concatenate(rows), n_in)
  return Planes(qtype, q, s, n_in, splits)


class Matrix:
  """One matrix packed alone (the output head): ``m(x) -> T x n_out``, single-threaded."""

  def __init__(self, qtype: str, raw, n_out: int, n_in: int):
    Wb, Sb = _Buf(), _Buf()
    self.desc = np.array(_desc_row(Wb, Sb, qtype, raw, n_out, n_in), np.int64)
    self.W, self.S, self.n_out = Wb.array(), Sb.array(), n_out

  def __call__(self, x_TxI: np.ndarray, batched: bool = True) -> np.ndarray:
    x = np.ascontiguousarray(x_TxI, np.float32)
    return pk.matmul_desc(self.desc, self.W, self.S, x, batched and x.shape[0] >= 2)[:, :self.n_out]


# ------------------------------------------------------------------------------------------ all layers

SLOTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
VECTORS = ("attn_norm.weight", "ffn_norm.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_q_norm.weight",
           "attn_k_norm.weight")


@dataclasses.dataclass(frozen=True)
class Pack:
  """The planes of L consecutive blocks (module docstring); ``slice`` gives layers [a, b) as views."""
  W: np.ndarray
  S: np.ndarray
  desc: np.ndarray  # int64 (L, 7, 6)
  V: np.ndarray  # float32
  vd: np.ndarray  # int64 (L, 7)
  d_ff: int

  @property
  def nbytes(self) -> int:
    return self.W.nbytes + self.S.nbytes


def pack_layers(mapped, layer_ids: list) -> Pack:
  """The bound layers of a mapped GGUF as one Pack (a one-time copy into anonymous memory, not the file's pages)."""
  info = mapped.info
  Wb, Sb = _Buf(), _Buf()
  desc, vd, vecs, vn = [], [], [], 0
  for i in layer_ids:
    row = []
    for s in SLOTS:
      t = info.tensors[f"blk.{i}.{s}.weight"]
      row.append(_desc_row(Wb, Sb, t.qtype, mapped.view(t.name), t.shape[0], t.shape[1]))
    desc.append(row)
    offs = []
    for v in VECTORS:
      name = f"blk.{i}.{v}"
      if name in info.tensors:
        a = np.asarray(mapped.view(name), np.float32).ravel()
        offs.append(vn)
        vecs.append(a)
        vn += a.size
      else:
        offs.append(-1)
    vd.append(offs)
  V = np.concatenate(vecs) if vecs else np.zeros(1, np.float32)
  return Pack(Wb.array(), Sb.array(), np.array(desc, np.int64).reshape(len(layer_ids), 7, 6), V,
              np.array(vd, np.int64).reshape(len(layer_ids), 7), info.cfg.ff)


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


def _r64(n: int) -> int:
  return -(-n // R) * R


class Team:
  """The kernel threads of one Pack: n-1 helper threads that live inside ``planes_kernels.worker`` (no GIL,
  no Python between calls: they poll a control block, then nap) and the caller as thread 0. ``run`` publishes
  a job (the per-call arrays as addresses) and runs the caller's share; the step's barriers do the rest."""

  def __init__(self, pack: Pack, n: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, cos, sin,
               neox: bool = False):
    self.pack, self.n = pack, n
    self.dims = (n_heads, n_kv_heads, head_dim, pack.d_ff, np.float32(eps), bool(neox))
    self.sync = np.zeros(32, np.int64)
    self.ctrl = np.zeros(32, np.int64)
    self.cos, self.sin = cos, sin
    H, K, E, F, eps32, nx = self.dims
    args = (pack.desc, pack.W, pack.S, pack.V, pack.vd, cos, sin, H, K, E, F, eps32, nx)
    threads = [threading.Thread(target=pk.worker, args=(tid, n, self.sync, self.ctrl, 0) + args, daemon=True,
                                name=f"ondevice-kernel-{tid}") for tid in range(1, n)]
    for t in threads:
      t.start()
    # Stopped when the team goes away or at interpreter exit (before the arrays they read are torn down).
    self._finalizer = weakref.finalize(self, _stop, self.ctrl, threads)

  def run(self, l0: int, l1: int, x, k_LxSxKxE, v_LxSxKxE, pos0: int, tiny: bool, cut: int = -1) -> np.ndarray:
    p, (H, K, E, F, eps, neox) = self.pack, self.dims
    T, D = x.shape
    bufs = (np.empty((T, _r64(H * E) + 2 * _r64(K * E)), np.float32), np.empty((T, H * E), np.float32),
            np.empty((T, _r64(D)), np.float32), np.empty((T, _r64(F)), np.float32))
    out = np.empty_like(x)
    if self.n > 1:
      c = self.ctrl
      for i, v in ((pk.C_T, T), (pk.C_POS, pos0), (pk.C_TINY, int(tiny)), (pk.C_L0, l0), (pk.C_L1, l1),
                   (pk.C_S, k_LxSxKxE.shape[1]), (pk.C_CUT, cut)):
        c[i] = v
      for i, a in zip((pk.C_X, pk.C_OUT, pk.C_K, pk.C_V, pk.C_QKV, pk.C_ATT, pk.C_Y, pk.C_A),
                      (x, out, k_LxSxKxE, v_LxSxKxE) + bufs):
        c[i] = a.ctypes.data
      _publish(c)
    pk.step(0, self.n, self.sync, x, out, p.desc[l0:l1], p.W, p.S, p.V, p.vd[l0:l1], k_LxSxKxE, v_LxSxKxE, self.cos,
            self.sin, pos0, H, K, E, F, eps, neox, tiny, cut, *bufs)
    return out

  def close(self) -> None:
    self._finalizer()


def layers(team: Team, l0: int, l1: int, x_TxD, k_LxSxKxE, v_LxSxKxE, pos0: int,
           batch_invariant: bool = False, cut: int = -1) -> np.ndarray:
  """Blocks [l0, l1) of the team's pack for T tokens; writes K/V rows pos0.. into the given caches (their
  L axis = those blocks). With T >= 2 the arithmetic follows llama.cpp's batched orders unless
  ``batch_invariant`` (then each token's result equals what a one-token pass gives: speculative
  verification relies on it). ``cut``: see planes_kernels.step (pack index, -1: none)."""
  x = np.ascontiguousarray(x_TxD, np.float32)
  return team.run(l0, l1, x, k_LxSxKxE, v_LxSxKxE, pos0, x.shape[0] >= 2 and not batch_invariant, cut)


def rope_tables(max_len: int, head_dim: int, theta: float, freq_factors=None, freq_scale: float = 1.0) -> tuple:
  """(cos, sin) [max_len, head_dim/2] as ggml builds them (ggml_rope_cache_init): theta_i = pos * s^i by repeated
  float32 multiplication with s = powf(theta, -2/head_dim), divided by freq_factors[i] (Llama 3's rope_freqs),
  times freq_scale, then libm's cosf / sinf (glibc; numpy's float32 cos differs in the last bit for some
  arguments, which changes llama.cpp-exact results)."""
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
  if freq_factors is not None:
    th = (th / np.asarray(freq_factors, np.float32)[None, :head_dim // 2]).astype(np.float32)
  th = (np.float32(freq_scale) * th).astype(np.float32)
  flat = th.ravel()
  cos = np.fromiter((libm.cosf(v) for v in flat.tolist()), np.float32, flat.size).reshape(th.shape)
  sin = np.fromiter((libm.sinf(v) for v in flat.tolist()), np.float32, flat.size).reshape(th.shape)
  return cos, sin


def inspect_asm(qtype: str = "Q4_0") -> str:
  """Assembly of a freshly compiled mat-vec of ``qtype`` (numba cannot show cached code): look for vpdpbusd."""
  import gguf
  import numba
  w = np.random.default_rng(0).normal(size=(R, 256)).astype(np.float32)
  m = Matrix(qtype, gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype)), R, 256)
  f = numba.njit(pk.matmul_desc.py_func)
  f(m.desc, m.W, m.S, np.ones((1, 256), np.float32), False)
  return "\n".join(f.inspect_asm().values())
