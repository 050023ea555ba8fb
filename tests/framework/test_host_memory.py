"""framework/host_memory.py: malloc keeps a step's freed temp buffer, so the next step does not fault it afresh."""
import subprocess
import sys

import pytest

_ROOT = __file__.rsplit("/tests/", 1)[0]

_FAULTS_CHILD = """
import ctypes, os, resource, sys
from framework import host_memory
if sys.argv[1] == "keep":
  assert host_memory.apply() and host_memory.state() == "keep_freed"
elif sys.argv[1] == "opt-out":
  os.environ[host_memory.ENV] = "default"
  assert not host_memory.apply() and host_memory.state() == "default"
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]


def faults(size, threaded=False):
  # plain malloc/free, as XLA:CPU allocates its temp buffer (numpy would madvise huge pages); XLA runs steps on
  # its own threads, whose arenas glibc caps at 64 MiB
  out = []
  def body():
    for _ in range(3):
      r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      p = libc.malloc(size)
      ctypes.memset(p, 1, size)
      libc.free(p)
      out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
  if threaded:
    import threading
    t = threading.Thread(target=body)
    t.start(); t.join()
  else:
    body()
  return out[-1]
print(faults(48 * 2 ** 20), faults(96 * 2 ** 20, threaded=True))
"""


def _faults(mode):
  out = subprocess.run([sys.executable, "-c", _FAULTS_CHILD, mode], cwd=_ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  return [int(x) for x in out.stdout.split()[-2:]]


def test_keep_freed_memory_stops_per_step_page_faults_of_large_buffers():
  """Default glibc: a 48 MiB buffer allocated again faults all 12,288 pages afresh, and so does a 96 MiB one on a
  worker thread. With the settings: < 5% of them, the thread's block included (one arena for all threads)."""
  pages48, pages96 = 48 * 2 ** 20 / 4096, 96 * 2 ** 20 / 4096
  default, keep, opt_out = _faults("default"), _faults("keep"), _faults("opt-out")
  assert default[0] > 0.9 * pages48 and default[1] > 0.9 * pages96
  assert keep[0] < 0.05 * pages48 and keep[1] < 0.05 * pages96
  assert opt_out[0] > 0.9 * pages48  # PRISM_HOST_MALLOC=default leaves the allocator alone


def test_the_train_entry_point_applies_it_before_loading_anything(monkeypatch, tmp_path):
  from experiments import run
  from framework import host_memory
  calls = []
  monkeypatch.setattr(host_memory, "apply", lambda: calls.append(1) or True)
  with pytest.raises(Exception):
    run.main(["--config", str(tmp_path / "missing.py"), "--workdir", str(tmp_path)])
  assert calls == [1]
