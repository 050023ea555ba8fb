"""A child that dies with its parent: the kernel signals it when the parent exits (no orphans after a crash).

``prctl`` is looked up here, at import, in the parent: the call after fork then only enters libc. A ``dlopen``
between fork and exec of a multithreaded parent (jax, zmq) could deadlock on a lock another thread held.
"""
import ctypes
import signal

try:
  _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:  # not glibc: children may outlive a crashed parent
  _PRCTL = None

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
  """Call in the child (``preexec_fn``, or right after ``os.fork``)."""
  if _PRCTL is not None:
    _PRCTL(PR_SET_PDEATHSIG, sig)


def term_with_parent() -> None:
  """SIGTERM when the parent dies: for children that own resources (shared memory) and clean up on SIGTERM."""
  die_with_parent(signal.SIGTERM)
