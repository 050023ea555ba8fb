"""mmap-backed GGUF weights: zero-copy tensor views, per-layer byte ranges, prefetch and release.

Release needs both calls: ``madvise(MADV_DONTNEED)`` only drops this process's page-table entries,
``posix_fadvise(POSIX_FADV_DONTNEED)`` is what actually evicts the (clean) pages from the page cache
(measured with ``resident_bytes``; tests/ondevice/test_weights.py checks that ``release`` evicts). Prefetch is ``madvise(MADV_WILLNEED)`` (asynchronous
read-ahead); ``touch=True`` additionally reads one byte per 4 pages, as prima.cpp's ``--force`` does,
which blocks until the data is in.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import resource
import zlib
from typing import Iterable, Optional

import numpy as np

from ondevice.gguf_io import GGUFError, GGUFInfo, read_info

PAGE = mmap.PAGESIZE
_QBLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
# byte offset and count of each block's f16 scales: d (and dmin) first, except Q6_K's d at the end
_SCALES = {"Q8_0": (0, 1), "Q4_0": (0, 1), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, 1)}


def _round_out(start: int, end: int) -> tuple:
  return start - start % PAGE, min(-(-end // PAGE) * PAGE, 1 << 62)


def _round_in(start: int, end: int) -> tuple:
  return -(-start // PAGE) * PAGE, end - end % PAGE


class MappedGGUF:
  """One read-only mapping of a GGUF file; every tensor is a numpy view into it (no copies)."""

  def __init__(self, path_or_info):
    self.info: GGUFInfo = path_or_info if isinstance(path_or_info, GGUFInfo) else read_info(path_or_info)
    self.fd = os.open(self.info.path, os.O_RDONLY)
    self.mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
    self._u8 = np.frombuffer(self.mm, np.uint8)
    self._views: dict = {}

  # ------------------------------------------------------------------ views
  def view(self, name: str) -> np.ndarray:
    """Zero-copy view: float32/float16 (n_out, n_in) or uint8 (n_out, row_bytes) for block quants."""
    v = self._views.get(name)
    if v is not None:
      return v
    t = self.info.tensors[name]
    raw = self._u8[t.offset:t.offset + t.nbytes]
    _verify(self.info, name, raw)
    if t.qtype == "F32":
      v = raw.view(np.float32).reshape(t.shape)
    elif t.qtype == "F16":
      v = raw.view(np.float16).reshape(t.shape)
    elif t.qtype == "BF16":
      v = raw.view(np.uint16).reshape(t.shape)
    elif t.qtype in _QBLOCK:
      v = raw.reshape(t.shape[0], -1) if len(t.shape) == 2 else raw
    else:
      raise NotImplementedError(f"{name} is {t.qtype}; the runtime computes on F32/F16/Q8_0/Q4_0/Q4_K/Q5_K/Q6_K "
                                f"files (re-export with --quant q8_0 or q4_0)")
    self._views[name] = v
    return v

  @property
  def base_address(self) -> int:
    return self._u8.ctypes.data

  # ------------------------------------------------------------------ ranges
  def layers_range(self, layers: Iterable[int]) -> tuple:
    rs = [self.info.layer_range(i) for i in layers]
    return min(r[0] for r in rs), max(r[1] for r in rs)

  def head_ranges(self) -> list:
    """Byte ranges of the non-layer tensors (embedding, final norm, output)."""
    return [(t.offset, t.offset + t.nbytes) for n, t in self.info.tensors.items() if not n.startswith("blk.")]

  # ------------------------------------------------------------------ residency control
  def prefetch(self, start: int, end: int, touch: bool = False) -> None:
    a, b = _round_out(start, end)
    b = min(b, len(self.mm))
    if b > a:
      self.mm.madvise(mmap.MADV_WILLNEED, a, b - a)
      if touch:  # fault in every 4th page now (prima.cpp --force); the sum forces the reads
        int(self._u8[a:b:4 * PAGE].sum())

  def release(self, start: int, end: int) -> None:
    a, b = _round_in(start, end)
    if b > a:
      self.mm.madvise(mmap.MADV_DONTNEED, a, b - a)
      os.posix_fadvise(self.fd, a, b - a, os.POSIX_FADV_DONTNEED)

  def resident_bytes(self, start: int = 0, end: Optional[int] = None) -> int:
    """Bytes of [start, end) in the page cache (mincore), page granular."""
    end = len(self.mm) if end is None else end
    a, b = _round_out(start, end)
    b = min(b, -(-len(self.mm) // PAGE) * PAGE)
    n = (b - a) // PAGE
    if n <= 0:
      return 0
    vec = (ctypes.c_ubyte * n)()
    rc = _libc().mincore(ctypes.c_void_p(self.base_address + a), ctypes.c_size_t(b - a), vec)
    if rc != 0:
      raise OSError(ctypes.get_errno(), "mincore failed")
    return int(sum(v & 1 for v in vec)) * PAGE

  def close(self) -> None:
    self._views.clear()
    self._u8 = None
    try:
      self.mm.close()
    except BufferError:  # a caller still holds a view; the mapping goes with the last reference
      pass
    os.close(self.fd)


def _verify(info: GGUFInfo, name: str, raw: np.ndarray) -> None:
  """The tensor's CRC32 (files we exported) and finite scales / values (any file): a damaged file fails
  here, naming the tensor, instead of producing NaN logits or silently wrong tokens."""
  fix = "re-export it with `python -m ondevice.export` or re-copy it"
  want, qtype = info.crc.get(name, (None, None))
  if want is not None and qtype in (None, info.tensors[name].qtype) and zlib.crc32(raw) != want:
    raise GGUFError(f"{info.path}: tensor {name} fails its CRC32 check (the file changed after export); {fix}")
  t = info.tensors[name]
  if t.qtype in _QBLOCK:
    o, n = _SCALES[t.qtype]
    vals = raw.reshape(-1, _QBLOCK[t.qtype][1])[:, o:o + 2 * n].copy().view(np.float16)
  elif t.qtype in ("F32", "F16", "BF16"):
    vals = raw.view(np.float32) if t.qtype == "F32" else raw.view(np.float16) if t.qtype == "F16" else \
        (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
  else:
    return
  if not np.isfinite(vals).all():
    raise GGUFError(f"{info.path}: tensor {name} holds non-finite {'block scales' if t.qtype in _QBLOCK else 'values'} "
                    f"(a damaged file); {fix}")


_LIBC = None


def _libc():
  global _LIBC
  if _LIBC is None:
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
    _LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
  return _LIBC


def io_counters() -> dict:
  """Major page faults (getrusage) and bytes this process read from storage (/proc/self/io)."""
  ru = resource.getrusage(resource.RUSAGE_SELF)
  out = {"major_faults": ru.ru_majflt, "max_rss_mb": ru.ru_maxrss / 1024}
  try:
    with open("/proc/self/io") as f:
      for line in f:
        k, v = line.split(":")
        if k in ("read_bytes", "rchar"):
          out[k] = int(v)
  except OSError:
    pass
  return out
