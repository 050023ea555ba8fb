"""Pinned local processes for validation: N copies of a command, process i on its own core.

``parallelism.distributed.launch_local`` starts ``experiments.run`` children but cannot pin them; a
fair real-vs-emulated comparison on a shared CPU needs every rank on its own core (and the emulated
rank on the same core as the real rank 0), so each child starts as a two-line trampoline that sets
``os.sched_setaffinity`` and then ``exec``s the command (threads jax starts later inherit the mask).
Not ``preexec_fn``: that runs Python between fork and exec of a multithreaded (jax) parent, which
CPython documents as able to deadlock the child. Output goes to temporary files, not pipes, so a
chatty child never blocks on a full pipe while its peers wait for it in a collective. Every child is
killed (SIGKILL on its process group: gloo peers can hang after a failure) on return, error or timeout.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from framework import xla_flags

# XLA:CPU on one pinned core: one compute thread, so the process does not time-slice with itself.
SINGLE_CORE_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def cores() -> list:
  return sorted(os.sched_getaffinity(0))


def machine_cores() -> list:
  """Every online core, also from a process pinned to fewer (children may be pinned anywhere)."""
  return list(range(os.cpu_count() or 1))


@dataclasses.dataclass
class Done:
  rc: list
  stdout: list
  stderr: list
  wall_s: float


_TRAMPOLINE = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.execv(sys.argv[2], sys.argv[2:])"


def pinned(cmd: Sequence[str], core: Optional[int]) -> list:
  """``cmd`` run on ``core`` only (unchanged when ``core`` is None); the mask is set before ``cmd`` starts."""
  cmd = list(cmd)
  if core is None:
    return cmd
  exe = cmd[0] if os.path.isabs(cmd[0]) else (shutil.which(cmd[0]) or cmd[0])
  return [sys.executable, "-c", _TRAMPOLINE, str(int(core)), exe, *cmd[1:]]


def base_env(devices_per_process: int = 1) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = xla_flags.with_host_device_count(devices_per_process, SINGLE_CORE_XLA_FLAGS)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = _root() + os.pathsep + env.get("PYTHONPATH", "")
  env.setdefault("OMP_NUM_THREADS", "1")
  return env


def _root() -> str:
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_pinned(cmds: Sequence[Sequence[str]], pin: Sequence[Optional[int]], env: Optional[dict] = None,
               timeout_s: float = 900.0) -> Done:
  """Runs ``cmds[i]`` on core ``pin[i]`` concurrently; waits for all (a failure kills the rest)."""
  env = env or base_env()
  t0 = time.perf_counter()
  procs, files = [], []
  deadline = time.time() + timeout_s
  try:
    for cmd, core in zip(cmds, pin):
      out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
      files.append((out, err))
      procs.append(subprocess.Popen(pinned(cmd, core), env=env, cwd=_root(), stdout=out, stderr=err,
                                    start_new_session=True, text=True))
    while True:
      codes = [p.poll() for p in procs]
      if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
        break
      if time.time() > deadline:
        break
      time.sleep(0.1)
  finally:
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      p.wait()
    outs = [[read_back(f) for f in pair] for pair in files]
    for f in (f for pair in files for f in pair):
      f.close()
  rc = [124 if p.returncode in (None, -signal.SIGKILL) and time.time() > deadline else p.returncode for p in procs]
  return Done(rc=rc, stdout=[o[0] for o in outs], stderr=[o[1] for o in outs], wall_s=time.perf_counter() - t0)


def read_back(f) -> str:
  """All a child wrote to the temporary file ``f`` (its stdout or stderr)."""
  f.seek(0)
  return f.read()


def python(*args) -> list:
  return [sys.executable, *args]
