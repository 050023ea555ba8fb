"""One run per workdir: a lock file that names its holder, and the checks made before a run writes anything.

The lock is ``<workdir>/.prismllm.lock``, held with ``flock`` for the life of the run: the kernel releases it
when the holder exits however it exits, so a SIGKILLed run never blocks the next one. The file's one line
names the holder (``{"pid", "host", "since"}``) and is emptied on a clean release; a line left by a holder that
is gone (its pid no longer runs on this host) is a stale lock, taken over with a message. A second run
while the holder lives is refused at once, in one line naming it. The hot-swap launcher (resilience/)
takes the same lock and lets its node agents inherit it, so the lock is free only when the last of them
has exited: ``lock(..., wait_for_dead_holder_s=...)`` waits that long for the processes of a holder that
is gone to finish.

This module imports no jax: the hot-swap controller uses it too.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from typing import Optional

log = logging.getLogger("prismllm")
LOCK_NAME = ".prismllm.lock"


class WorkdirError(RuntimeError):
  """A workdir that cannot be used (a file, in use by another run, not writable); the message names the fix."""


def check_path(workdir: str) -> str:
  """The absolute workdir; raises WorkdirError if it exists and is not a folder, or a parent is a file."""
  workdir = os.path.abspath(workdir)
  p = workdir
  while p and p != os.path.dirname(p):
    if os.path.exists(p) and not os.path.isdir(p):
      what = "--workdir" if p == workdir else f"--workdir {workdir}: its parent"
      raise WorkdirError(f"{what} {p} is a file, not a folder: pass a folder path (or move the file away)")
    p = os.path.dirname(p)
  return workdir


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # exists, owned by someone else
  return True


def _holder(fd: int) -> Optional[dict]:
  raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
  if not raw:
    return None
  try:
    h = json.loads(raw)
    return h if isinstance(h, dict) else {"raw": raw}
  except ValueError:
    return {"raw": raw}


def _describe(h: Optional[dict]) -> str:
  if not h:
    return "a process that has not written its name yet"
  if "pid" in h:
    return f"pid {h['pid']} on host {h.get('host', '?')} (since {h.get('since', '?')})"
  return repr(h.get("raw", h))[:80]


def _gone(h: Optional[dict]) -> bool:
  """The holder named in the file is known not to run any more (same host, pid not alive)."""
  return bool(h) and h.get("host") == socket.gethostname() and isinstance(h.get("pid"), int) \
      and not _pid_alive(h["pid"])


_HELD: dict = {}  # lock path -> Lock held by this process (an entry point locks early, the loop again: one lock)


class Lock:
  """An acquired workdir lock (``release()`` or use as a context manager). Locking a workdir this process
  already holds returns the same lock with one more holder; the last ``release()`` frees it."""

  def __init__(self, fd: int, path: str):
    self.fd, self.path, self.holders = fd, path, 1

  def release(self) -> None:
    if self.fd is None:
      return
    self.holders -= 1
    if self.holders > 0:
      return
    _HELD.pop(self.path, None)
    try:
      os.ftruncate(self.fd, 0)  # a clean exit leaves no holder line (only a killed holder leaves a stale one)
    except OSError:
      pass
    os.close(self.fd)  # closing our descriptor drops the flock unless a child inherited it
    self.fd = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def lock(workdir: str, what: str = "run", inheritable: bool = False, wait_for_dead_holder_s: float = 0.0) -> Lock:
  """Creates ``workdir`` if needed and locks it for this process; raises WorkdirError naming the holder.

  ``inheritable``: children started with ``pass_fds`` hold it too. ``wait_for_dead_holder_s``: when the
  holder named in the file is gone but the lock is still held (its children are still exiting), wait
  up to this long for it."""
  workdir = check_path(workdir)
  path = os.path.join(workdir, LOCK_NAME)
  held = _HELD.get(path)
  if held is not None and held.fd is not None:
    held.holders += 1
    return held
  try:
    os.makedirs(workdir, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise WorkdirError(f"cannot create the lock file in --workdir {workdir} ({e.strerror or e}): check its "
                       f"permissions and free space, or use another --workdir") from None
  end = time.time() + wait_for_dead_holder_s
  while True:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      break
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        os.close(fd)
        raise WorkdirError(f"cannot lock {path} ({e.strerror}): use a --workdir on a file system that supports "
                           f"flock") from None
      h = _holder(fd)
      if _gone(h) and time.time() < end:
        time.sleep(0.1)
        continue
      os.close(fd)
      raise WorkdirError(f"--workdir {workdir} is in use by another {what}: {_describe(h)} holds {path}; wait for "
                         f"it to finish, stop it, or use another --workdir") from None
  stale = _holder(fd)
  if stale is not None:
    log.warning("took over the stale lock of %s in %s (that process no longer runs)", _describe(stale), workdir)
  me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
  os.ftruncate(fd, 0)
  os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
  os.set_inheritable(fd, inheritable)
  _HELD[path] = Lock(fd, path)
  return _HELD[path]
