"""Versioned, double-buffered snapshot slots in POSIX shared memory (/dev/shm files).

The node agent owns the files; its training worker maps the same file and writes snapshots into
it, so a crash of the worker loses nothing. Two slots per holder (own shard, or one buddy's
replica): one keeps the newest *committed* version while the other receives the next, so a crash
mid-write never destroys the last durable copy.

Plain mmap'd files are used instead of ``multiprocessing.shared_memory``: on Python 3.11 a process
that *attaches* to a SharedMemory registers it with its resource tracker, which unlinks the segment
when that process dies -- exactly the crash we must survive.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import zlib
from typing import Optional

import numpy as np

ALIGN = 4096


def shm_dir() -> str:
  return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"


def round_up(n: int, a: int = ALIGN) -> int:
  return (n + a - 1) // a * a


def checksum(buf) -> int:
  return zlib.crc32(buf) & 0xFFFFFFFF


@dataclasses.dataclass
class SlotMeta:
  version: int = -1
  nbytes: int = 0
  crc: int = 0
  gen: int = -1
  complete: bool = False


class SlotFile:
  """Two slots of ``slot_bytes`` each in one mmap'd shared-memory file."""

  def __init__(self, path: str, slot_bytes: int, create: bool):
    self.path, self.slot_bytes = path, round_up(slot_bytes)
    size = 2 * self.slot_bytes
    if create:
      fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
      os.ftruncate(fd, size)
    else:
      fd = os.open(path, os.O_RDWR)
      if os.fstat(fd).st_size < size:
        os.close(fd)
        raise RuntimeError(f"{path} is smaller than 2 x {slot_bytes} bytes: the agent allocated another layout")
    self.mm = mmap.mmap(fd, size)
    os.close(fd)
    self.buf = np.frombuffer(self.mm, dtype=np.uint8)
    self.meta = [SlotMeta(), SlotMeta()]
    if create:
      self.buf[:] = 0  # touch every page now: first-touch page faults cost ~30x a warm copy

  def view(self, slot: int, nbytes: Optional[int] = None) -> np.ndarray:
    start = slot * self.slot_bytes
    return self.buf[start:start + (self.slot_bytes if nbytes is None else nbytes)]

  def find(self, version: int) -> Optional[int]:
    for i, m in enumerate(self.meta):
      if m.complete and m.version == version:
        return i
    return None

  def slot_for_write(self, protect_version: int) -> int:
    """The slot that does not hold ``protect_version`` (the last committed one)."""
    keep = self.find(protect_version)
    if keep is not None:
      return 1 - keep
    # nothing to protect: overwrite the older / incomplete one
    return 0 if (not self.meta[0].complete or self.meta[0].version <= self.meta[1].version) else 1

  def verify(self, slot: int) -> bool:
    m = self.meta[slot]
    return m.complete and checksum(self.view(slot, m.nbytes)) == m.crc

  def close(self, unlink: bool = False):
    try:
      del self.buf
      self.mm.close()
    except (BufferError, ValueError):
      pass  # a zero-copy send may still reference it; the OS frees it at exit
    if unlink:
      try:
        os.unlink(self.path)
      except FileNotFoundError:
        pass
