"""mmap views, per-layer ranges, prefetch/release (real page cache where the filesystem allows)."""
import os
import shutil
import subprocess

import pytest

from ondevice.weights import PAGE, MappedGGUF, io_counters


def test_views_are_zero_copy_into_the_mapping(files):
  m = MappedGGUF(files["q4_0"])
  v = m.view("blk.1.ffn_up.weight")
  t = m.info.tensors["blk.1.ffn_up.weight"]
  assert not v.flags.owndata and not v.flags.writeable
  assert v.ctypes.data == m.base_address + t.offset
  with open(files["q4_0"], "rb") as f:
    f.seek(t.offset)
    assert f.read(64) == v.reshape(-1)[:64].tobytes()


def _fs_type(path):
  out = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True, timeout=10)
  return out.stdout.strip()


def test_prefetch_and_release_change_residency(files, tmp_path):
  # tmpfs pages cannot be evicted; use a disk-backed folder when /tmp is tmpfs.
  base = str(tmp_path)
  if _fs_type(base) in ("tmpfs", "ramfs"):
    base = os.path.join(os.path.dirname(__file__), ".scratch")
    os.makedirs(base, exist_ok=True)
  path = os.path.join(base, "w.gguf")
  shutil.copy(files["f32"], path)
  fd = os.open(path, os.O_RDONLY)
  os.fsync(fd)  # fadvise(DONTNEED) cannot drop dirty pages of a file just written
  os.close(fd)
  try:
    m = MappedGGUF(path)
    a, b = m.layers_range([1, 2])
    m.prefetch(a, b, touch=True)
    full = m.resident_bytes(a, b)
    assert full >= (b - a) - 2 * PAGE
    m.release(a, b)
    after = m.resident_bytes(a, b)
    if _fs_type(base) in ("tmpfs", "ramfs", "overlay"):
      pytest.skip(f"{_fs_type(base)} cannot evict pages (resident {after} of {full}); release not observable")
    assert after < full
    m.prefetch(a, b, touch=True)
    assert m.resident_bytes(a, b) >= full - 2 * PAGE
    assert "major_faults" in io_counters()
    m.close()
  finally:
    os.remove(path)
