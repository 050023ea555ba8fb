"""Q4_0 / Q8_0 weights repacked once at load into SIMD-friendly planes, and the calls that run them.

Why: ggml's row-major blocks (18/34 bytes, f16 scale first) make the per-row inner loop a 32-element
horizontal sum with unaligned scale loads, which numba/LLVM does not vectorise well (``kernels.py``
computes on them in the mmap at 1.4 ms per 2816x1024 Q4_0 mat-vec). In the planes layout R=64 rows are
interleaved: for each (row group g, block b) one contiguous run holds the R rows' f32 scales, then,
position by position, the R rows' nibble bytes (Q4_0: 16 bytes = 32 weights per row) or int8s (Q8_0).
Same quantised values; f32 scales cost +11% bytes (Q4_0) / +6% (Q8_0). Matrices that read the same
input (wq/wk/wv, w_gate/w_up) are packed together into one ``Planes``.

This module holds the layout (``repack``, ``Planes``, ``stack``/``Stack``) and the Python entry points
(``layer``, ``layers``, ``act_q8``, ``rms_norm``, ``inspect_asm``); the compiled kernels they call are in
``planes_kernels.py`` (which also sets numba's vector width on import: see there).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ondevice.planes_kernels import (HAVE_NUMBA, QK, R, _act_q8_py, _layer_py, _layers_py, _planes_matmul,
                                     _q4_0_planes_py, _q8_0_planes_py, _rms_norm)

PLANE_BYTES = {"Q4_0": 20, "Q8_0": 36}  # bytes per row per block in planes: f32 scale + 16 or 32 bytes
GGML_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}


def rms_norm(x_TxD: np.ndarray, w_D: np.ndarray, eps: float) -> np.ndarray:
  """ggml's rms_norm (see _rms_norm), in numba when available, else in numpy with the same roundings."""
  x_TxD = np.ascontiguousarray(x_TxD, np.float32)
  if HAVE_NUMBA:
    return _rms_norm(x_TxD, np.ascontiguousarray(w_D, np.float32), np.float32(eps))
  mean = (x_TxD * x_TxD).astype(np.float64).sum(-1, keepdims=True) / x_TxD.shape[-1]
  sc = np.float32(1.0) / np.sqrt(mean.astype(np.float32) + np.float32(eps))
  return (x_TxD * sc) * w_D


def act_q8(x_TxI: np.ndarray) -> tuple:
  """(x', block sums of x'): activations quantised to Q8_0 as ggml does on x86, returned as float32."""
  x_TxI = np.ascontiguousarray(x_TxI, np.float32)
  T, n_in = x_TxI.shape
  if HAVE_NUMBA:
    xq, xs = np.empty((T, n_in), np.float32), np.empty((T, n_in // QK), np.float32)
    _act_q8_py(x_TxI, xq, xs)
    return xq, xs
  xb = x_TxI.reshape(T, -1, QK)
  amax = np.abs(xb).max(-1, keepdims=True)
  inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
  q = np.rint(xb * inv)
  xq = q * (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)
  return xq.reshape(T, n_in).astype(np.float32), xq.sum(-1, dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class Planes:
  """One or more quantised matrices with the same n_in, repacked into planes. ``splits`` are the row
  offsets of the member matrices; calling returns one T x n_out_i array per member."""
  qtype: str
  buf: np.ndarray  # uint8 (G, n_in/32, PLANE_BYTES * R)
  n_in: int
  splits: tuple  # (0, n_out_0, n_out_0 + n_out_1, ...)

  @property
  def is_q4(self) -> bool:
    return self.qtype == "Q4_0"

  @property
  def nbytes(self) -> int:
    return self.buf.nbytes

  def __call__(self, x_TxI: np.ndarray) -> list:
    out = _planes_matmul(self.buf, self.is_q4, np.ascontiguousarray(x_TxI, np.float32))
    s = self.splits
    return [out[:, s[i]:s[i + 1]] for i in range(len(s) - 1)]


def repack(qtype: str, raws: list, n_in: int) -> Planes:
  """Row-major ggml blocks (each uint8 (n_out_i, n_in/32 * block bytes)) -> one Planes over all rows.

  A one-time copy at load into anonymous memory (not the file's pages); no f32 weights are made."""
  if qtype not in PLANE_BYTES or n_in % QK:
    raise NotImplementedError(f"no planes for {qtype} with n_in={n_in}; use kernels.matmul on the mmap view")
  nb = n_in // QK
  rows = [np.asarray(r, np.uint8).reshape(-1, nb, GGML_BLOCK_BYTES[qtype]) for r in raws]
  splits = tuple(np.cumsum([0] + [r.shape[0] for r in rows]).tolist())
  blk = np.concatenate(rows) if len(rows) > 1 else rows[0]
  n_out = blk.shape[0]
  G = -(-n_out // R)
  if G * R != n_out:  # pad the last group with zero rows (scale 0): their outputs are sliced away
    blk = np.concatenate([blk, np.zeros((G * R - n_out, nb, blk.shape[2]), np.uint8)])
  pb = PLANE_BYTES[qtype]
  d_GxRxB = blk[..., :2].copy().view(np.float16)[..., 0].astype(np.float32).reshape(G, R, nb)
  q_GxRxBxJ = blk[..., 2:].reshape(G, R, nb, pb - 4)
  buf = np.empty((G, nb, pb * R), np.uint8)
  buf[:, :, :4 * R] = np.ascontiguousarray(d_GxRxB.transpose(0, 2, 1)).view(np.uint8).reshape(G, nb, 4 * R)
  buf[:, :, 4 * R:] = q_GxRxBxJ.transpose(0, 2, 3, 1).reshape(G, nb, (pb - 4) * R)
  return Planes(qtype, buf, n_in, splits)


def layer(x_TxD, attn_norm, ffn_norm, qkv: Planes, wo: Planes, gate_up: Planes, down: Planes, k_SxKxE, v_SxKxE,
          cos_SxE2, sin_SxE2, pos0: int, n_heads: int, n_kv_heads: int, head_dim: int, eps: float):
  """One llama block on planes weights, in one call; writes K/V rows pos0.. into the cache arrays."""
  F = gate_up.splits[1]
  return _layer_py(np.ascontiguousarray(x_TxD, np.float32), attn_norm, ffn_norm, qkv.buf, qkv.is_q4, wo.buf,
                   wo.is_q4, gate_up.buf, gate_up.is_q4, down.buf, down.is_q4, F, k_SxKxE, v_SxKxE, cos_SxE2,
                   sin_SxE2, pos0, n_heads, n_kv_heads, head_dim, np.float32(eps))


@dataclasses.dataclass(frozen=True)
class Stack:
  """The planes of L consecutive blocks stacked along a leading axis (one array per kind), so that a
  decode step over all of them is one numba call (``layers``). The per-layer Planes are views of it."""
  attn_norm_LxD: np.ndarray
  ffn_norm_LxD: np.ndarray
  qkv: np.ndarray
  wo: np.ndarray
  gate_up: np.ndarray
  down: np.ndarray
  is_q4: tuple  # (qkv, wo, gate_up, down)
  d_ff: int


def stack(layer_planes: list, attn_norms: list, ffn_norms: list):
  """[(qkv, wo, gate_up, down) Planes per layer] -> (Stack, the same Planes as views of it), or None when
  the layers' planes differ in type or shape (then each block runs as its own call)."""
  kinds = list(zip(*layer_planes))
  if any(len({(p.qtype, p.buf.shape, p.splits) for p in k}) != 1 for k in kinds):
    return None
  bufs = [np.stack([p.buf for p in k]) for k in kinds]
  st = Stack(np.stack(attn_norms).astype(np.float32), np.stack(ffn_norms).astype(np.float32), *bufs,
             is_q4=tuple(k[0].is_q4 for k in kinds), d_ff=kinds[2][0].splits[1])
  views = [tuple(dataclasses.replace(p, buf=b[i]) for p, b in zip(lp, bufs))
           for i, lp in enumerate(layer_planes)]
  return st, views


def layers(st: Stack, x_TxD, k_LxSxKxE, v_LxSxKxE, cos_SxE2, sin_SxE2, pos0: int, n_heads: int, n_kv_heads: int,
           head_dim: int, eps: float):
  """All stacked blocks in one call; writes K/V rows pos0.. of every layer's cache."""
  q = st.is_q4
  return _layers_py(np.ascontiguousarray(x_TxD, np.float32), st.attn_norm_LxD, st.ffn_norm_LxD, st.qkv, q[0],
                    st.wo, q[1], st.gate_up, q[2], st.down, q[3], st.d_ff, k_LxSxKxE, v_LxSxKxE, cos_SxE2,
                    sin_SxE2, pos0, n_heads, n_kv_heads, head_dim, np.float32(eps))


def inspect_asm(qtype: str = "Q4_0") -> str:
  """Assembly of the planes kernel for ``qtype``, freshly compiled (numba cannot show cached code):
  look for zmm (AVX-512) or ymm (AVX2) registers in the row loop."""
  import gguf
  import numba
  w = np.random.default_rng(0).normal(size=(R, 64)).astype(np.float32)
  p = repack(qtype, [gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qtype))], 64)
  xq, xs = act_q8(np.ones((1, 64), np.float32))
  f = numba.njit(fastmath=True)((_q4_0_planes_py if p.is_q4 else _q8_0_planes_py).py_func)
  f(p.buf, xq, xs, np.empty((1, R), np.float32))
  return "\n".join(f.inspect_asm().values())
