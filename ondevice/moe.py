"""Mixture-of-experts feed-forward blocks on a mapped GGUF in llama.cpp's MoE layout (Mixtral: arch llama with
experts; Qwen3-MoE: arch qwen3moe), computed as llama.cpp's ``build_moe_ffn`` computes them on the CPU.

Per token and layer (llama.cpp, softmax gating, ``norm_w`` on for both architectures):
  logits = ffn_gate_inp @ h                      (the router, F32 in the file: llama.cpp never quantises it)
  p      = softmax(logits) over ALL experts      (ggml_soft_max: expf, sum in double, times float(1/sum))
  sel    = the n_used largest p, largest first   (ggml top-k)
  w      = p[sel] / sum(p[sel])                  (sum_rows in double, then an f32 divide)
  y_j    = down_e(silu(gate_e(h)) * up_e(h)) * w_j   for e = sel[j]   (mul_mat_id: one vec_dot per row/token)
  out    = y_0 + y_1 + ... + y_{k-1}             (in slot order)
Mixtral's "softmax over the top-k logits" is the same number as this renormalised top-k of the full softmax;
llama.cpp computes it this way for both files, so does this module. The per-expert matrices run on the planes
kernels (``planes.Matrix`` / ``planes_kernels.matmul_desc``) with ``batched=False``: the vec_dot order that
ggml's mul_mat_id uses for every row; the SwiGLU and the router softmax are ggml's (``moe_kernels.py``).

Only the routed experts are read. A stacked expert tensor (n_expert, rows, n_in) is indexed per expert into the
file's mapping: F16 / BF16 / F32 experts are computed in place on the mapped pages (no copy; ``matmul_desc``
reads the file bytes at the expert's offset), and so are Q8_0 / Q4_0 experts (``moe_kernels.file_matmul``: the
file's block layout, the planes kernels' arithmetic) until an expert has been used ``repack_after`` times: then
it is repacked into the planes layout (~1.4x faster per use; a repack, ~200 us, pays back after ~80 uses) and
kept in an LRU cache of ``cache_bytes`` (None: unbounded; 0: nothing is repacked) when it fits there. The
K-quants (Q4_K, Q5_K, Q6_K) are repacked when first routed and cached the same way (0: repacked from the file at
every use). Every in-place
use and every repack first asks for exactly the expert's pages (``MADV_WILLNEED``: one read, not a fault per
page). Both mappings of the file are ``MADV_RANDOM``: a page fault then reads that page, not the kernel's
read-around window about it (read_ahead_kb, 128 KB to megabytes), which would be other experts' pages (a fault
on one embedding row read this whole 2 MB test file on an 8 MB read-ahead disk). Files we export carry a CRC32
per expert (``name#e``), checked on first use.
``counts[layer, expert]`` counts routed tokens (activation frequency), ``mapped_bytes`` the expert bytes read
through the mapping (every in-place use, every repack).
"""
from __future__ import annotations

import collections
import mmap
import zlib
from typing import Optional

import numpy as np

from ondevice import matvec, moe_kernels, planes
from ondevice import planes_kernels as pk
from ondevice.gguf_check import EXPERT_MATS, GGUFError

GATE, UP, DOWN = EXPERT_MATS
_IN_PLACE = ("F16", "BF16", "F32")
# In place costs ~1.4x the planes kernel per use (512 x 512 Q8_0: ~9 vs ~6.5 us, one thread) and a repack ~200 us,
# so an expert is repacked (when the cache has room) only after this many uses.
REPACK_AFTER = 64
DUMMY_FF = 4 * planes.R  # the zero feed-forward block of the attention-only pack (at most 4 kernel threads)


class _InPlace:
  """An F16 / BF16 / F32 expert computed on the mapped file bytes at ``off`` (rows a multiple of 64)."""

  def __init__(self, qtype: str, W: np.ndarray, off: int, n_out: int, n_in: int):
    self.W, self.n_out = W, n_out
    self.desc = np.array([matvec.CODES[qtype], off, 0, n_out // planes.R, n_out, n_in], np.int64)
    self.S = np.zeros(64, np.uint8)
    self.nbytes = 0  # holds no copy

  def __call__(self, x_TxI: np.ndarray, batched: bool = False) -> np.ndarray:
    x = np.ascontiguousarray(x_TxI, np.float32)
    return pk.matmul_desc(self.desc, self.W, self.S, x, batched and x.shape[0] >= 2)[:, :self.n_out]


class _Repacked:
  """A Q8_0 / Q4_0 expert repacked into planes (moe_kernels.repack_q0): ``planes.Matrix``'s buffers and call."""

  def __init__(self, qtype: str, raw: np.ndarray, n_out: int, n_in: int):
    q, s = moe_kernels.repack_q0(qtype, raw, n_out, n_in)
    self.W, self.S = _padded(q), _padded(s.view(np.uint8))
    self.desc = np.array([matvec.CODES[qtype], 0, 0, q.shape[0], n_out, n_in], np.int64)
    self.n_out = n_out

  def __call__(self, x_TxI: np.ndarray, batched: bool = False) -> np.ndarray:
    x = np.ascontiguousarray(x_TxI, np.float32)
    return pk.matmul_desc(self.desc, self.W, self.S, x, batched and x.shape[0] >= 2)[:, :self.n_out]


class _FileQ0:
  """A Q8_0 / Q4_0 expert computed on the mapped file bytes at ``off`` (``moe_kernels.file_matmul``)."""

  def __init__(self, qtype: str, W: np.ndarray, off: int, n_out: int, n_in: int):
    self.qtype, self.W, self.off, self.n_out, self.n_in = qtype, W, off, n_out, n_in

  def __call__(self, x_TxI: np.ndarray, batched: bool = False) -> np.ndarray:
    # Q8_0 / Q4_0 mat-vecs have one order for any pass length (matvec.mat_groups): ``batched`` changes nothing.
    x = np.ascontiguousarray(x_TxI, np.float32)
    T, n = x.shape
    act = (np.empty((T, n), np.int8), np.empty((T, n // 32), np.float32), np.empty((T, n // 32), np.int32),
           np.empty((T, n // 4), np.int32))
    pk.act_q8(x, *act)
    return moe_kernels.file_matmul(self.qtype, self.W, self.off, self.n_out, self.n_in, act)


def _padded(a: np.ndarray) -> np.ndarray:
  """``planes._Buf`` of one piece: the bytes, zeros to a multiple of 64, then 64 more."""
  n = a.size
  out = np.zeros(n + (-n) % 64 + 64, np.uint8)
  out[:n] = a.reshape(-1)
  return out


class Experts:
  """The MoE blocks of the bound layers of a mapped MoE file (module docstring)."""

  def __init__(self, mapped, layer_ids, cache_bytes: Optional[int] = None, repack_after: int = REPACK_AFTER):
    info = mapped.info
    self.info, self.spec, self.cfg = info, info.moe, info.cfg
    self.layer_ids = list(layer_ids)
    # A private (copy-on-write, never written) mapping of the same file: writable arrays for the kernels, the
    # same page-cache pages as the engine's read-only mapping.
    self._mm = mmap.mmap(mapped.fd, 0, access=mmap.ACCESS_COPY)
    self._mm.madvise(mmap.MADV_RANDOM)
    mapped.mm.madvise(mmap.MADV_RANDOM)
    self.W = np.frombuffer(self._mm, np.uint8)
    self.router = {}
    for i in self.layer_ids:
      t = info.tensors[f"blk.{i}.ffn_gate_inp.weight"]
      self.router[i] = planes.Matrix(t.qtype, mapped.view(t.name), t.shape[0], t.shape[1])
    self.cache_bytes, self.repack_after = cache_bytes, repack_after
    self._uses: dict = {}
    self.in_place_uses = 0
    self._lru: collections.OrderedDict = collections.OrderedDict()
    self._held = 0
    self._checked: set = set()
    self.counts = np.zeros((info.cfg.n_layers, self.spec.n_expert), np.int64)
    self.mapped_bytes = 0
    self.repacks = 0

  # ------------------------------------------------------------------ one expert
  def expert_range(self, i: int, kind: str, e: int) -> tuple:
    """[start, end) file bytes of expert e of ``blk.i.<kind>.weight``."""
    t = self.info.tensors[f"blk.{i}.{kind}.weight"]
    per = t.nbytes // t.shape[0]
    return t.offset + e * per, t.offset + (e + 1) * per

  def _raw(self, i: int, kind: str, e: int) -> np.ndarray:
    name = f"blk.{i}.{kind}.weight"
    a, b = self.expert_range(i, kind, e)
    raw = self.W[a:b]
    key = f"{name}#{e}"
    if key not in self._checked:
      want, qt = self.info.crc.get(key, (None, None))
      if want is not None and qt in (None, self.info.tensors[name].qtype) and zlib.crc32(raw) != want:
        raise GGUFError(f"{self.info.path}: expert {e} of {name} fails its CRC32 check (the file changed after "
                        f"export); re-export it with `python -m ondevice.export` or re-copy it")
      self._checked.add(key)
    return raw

  def matrix(self, i: int, kind: str, e: int):
    """Expert e's matrix of ``kind`` in layer i: callable ``(x_TxI, batched) -> T x rows``."""
    t = self.info.tensors[f"blk.{i}.{kind}.weight"]
    n_out, n_in = t.shape[1], t.shape[2]
    if t.qtype in _IN_PLACE and n_out % planes.R == 0:
      return self._in_place(i, kind, e, lambda a: _InPlace(t.qtype, self.W, a, n_out, n_in))
    key = (i, kind, e)
    m = self._lru.get(key)
    if m is not None:
      self._lru.move_to_end(key)
      return m
    a, b = self.expert_range(i, kind, e)
    if t.qtype in moe_kernels.FILE_ROWS and planes.HAVE_NUMBA and n_out % moe_kernels.FILE_ROWS[t.qtype] == 0:
      self._uses[key] = uses = self._uses.get(key, 0) + 1
      fits = self.cache_bytes is None or b - a <= self.cache_bytes
      if uses <= self.repack_after or not fits or self.cache_bytes == 0:
        return self._in_place(i, kind, e, lambda a: _FileQ0(t.qtype, self.W, a, n_out, n_in))
    self._willneed(a, b)
    raw = self._raw(i, kind, e)
    if t.qtype in ("Q8_0", "Q4_0") and planes.HAVE_NUMBA:
      m = _Repacked(t.qtype, raw, n_out, n_in)
    else:
      m = planes.Matrix(t.qtype, raw.reshape(n_out, -1) if t.qtype not in _IN_PLACE else
                        raw.view(planes_dtype(t.qtype)).reshape(n_out, n_in), n_out, n_in)
    self.mapped_bytes += raw.nbytes
    self.repacks += 1
    size = m.W.nbytes + m.S.nbytes
    if self.cache_bytes is None or size <= self.cache_bytes:
      self._lru[key] = m
      self._held += size
      while self.cache_bytes is not None and self._held > self.cache_bytes:
        _, old = self._lru.popitem(last=False)
        self._held -= old.W.nbytes + old.S.nbytes
    return m

  def _willneed(self, a: int, b: int) -> None:
    a0 = a - a % mmap.PAGESIZE
    self._mm.madvise(mmap.MADV_WILLNEED, a0, b - a0)

  def _in_place(self, i: int, kind: str, e: int, make):
    a, b = self.expert_range(i, kind, e)
    self._willneed(a, b)
    self._raw(i, kind, e)
    self.mapped_bytes += b - a
    self.in_place_uses += 1
    return make(a)

  # ------------------------------------------------------------------ the block
  def route(self, i: int, h_TxD: np.ndarray, batched: bool) -> tuple:
    """(selected experts T x k, largest probability first; their normalised weights T x k, float32)."""
    logits = self.router[i](h_TxD, batched)
    k = self.spec.n_used
    sel = np.empty((len(logits), k), np.int64)
    w = np.empty((len(logits), k), np.float32)
    for t, row in enumerate(logits):
      p = moe_kernels.softmax(np.ascontiguousarray(row, np.float32))
      sel[t] = np.argsort(-p, kind="stable")[:k]
      ws = p[sel[t]]
      s = 0.0  # ggml_vec_sum_f32: a double accumulator, stored as float
      for v in ws:
        s += float(v)
      w[t] = ws / np.float32(s)
    return sel, w

  def ffn(self, i: int, h_TxD: np.ndarray, batched: bool = True) -> np.ndarray:
    """The MoE feed-forward output (T x D) of layer i for the normalised rows h (before the residual add).
    ``batched``: the router's pass is llama.cpp's batched one (T >= 2, not batch-invariant)."""
    h = np.ascontiguousarray(h_TxD, np.float32)
    T, D = h.shape
    sel, w = self.route(i, h, batched)
    k = sel.shape[1]
    y = np.empty((T, k, D), np.float32)
    for e in np.unique(sel):
      ts, js = np.nonzero(sel == e)
      self.counts[i, e] += len(ts)
      x = h[ts]
      g = self.matrix(i, GATE, e)(x, False)
      u = self.matrix(i, UP, e)(x, False)
      y[ts, js] = self.matrix(i, DOWN, e)(moe_kernels.swiglu(g, u), False) * w[ts, js][:, None]
    out = y[:, 0].copy()
    for j in range(1, k):
      out = out + y[:, j]
    return out

  def evict(self) -> None:
    """Empties the repacked-expert cache and drops this mapping's pages (the caller releases the file's other
    mapping: ``MappedGGUF.release``; the page cache drops pages no mapping holds)."""
    self._lru.clear()
    self._held = 0
    self._mm.madvise(mmap.MADV_DONTNEED)

  def stats(self) -> dict:
    return {"expert_cache_mb": None if self.cache_bytes is None else self.cache_bytes / 2**20,
            "expert_cache_held_mb": self._held / 2**20, "repacks": self.repacks,
            "in_place_uses": self.in_place_uses,
            "expert_mapped_mb": self.mapped_bytes / 2**20}

  def expert_bytes(self, i: int) -> int:
    """All experts' bytes of layer i (the three stacked tensors)."""
    return sum(self.info.tensors[f"blk.{i}.{k}.weight"].nbytes for k in EXPERT_MATS)


def planes_dtype(qtype: str):
  return {"F16": np.float16, "BF16": np.uint16, "F32": np.float32}[qtype]


def pack_attention(mapped, layer_ids) -> planes.Pack:
  """The bound layers' attention blocks as a planes Pack whose feed-forward block is zero (F16 zeros, so the
  fused step adds exactly 0.0 to the residual); the MoE block then runs outside it (``Experts.ffn``)."""
  info = mapped.info
  D = info.cfg.d_model
  Wb, Sb = planes._Buf(), planes._Buf()
  zero_up, zero_down = np.zeros((DUMMY_FF, D), np.float16), np.zeros((D, DUMMY_FF), np.float16)
  desc, vd, vecs, vn = [], [], [], 0
  for i in layer_ids:
    row = []
    for s in planes.SLOTS:
      if s in ("ffn_gate", "ffn_up"):
        row.append(planes._desc_row(Wb, Sb, "F16", zero_up, DUMMY_FF, D))
      elif s == "ffn_down":
        row.append(planes._desc_row(Wb, Sb, "F16", zero_down, D, DUMMY_FF))
      else:
        t = info.tensors[f"blk.{i}.{s}.weight"]
        row.append(planes._desc_row(Wb, Sb, t.qtype, mapped.view(t.name), t.shape[0], t.shape[1]))
    desc.append(row)
    offs = []
    for v in planes.VECTORS:
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
  return planes.Pack(Wb.array(), Sb.array(), np.array(desc, np.int64).reshape(len(layer_ids), 7, 6), V,
                     np.array(vd, np.int64).reshape(len(layer_ids), 7), DUMMY_FF)
