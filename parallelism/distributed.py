"""Multi-process runtime: JAX's own ``jax.distributed`` (gloo on CPU, NCCL on GPU), never a
home-made cluster layer; plus a localhost launcher that stands in for SLURM/mpirun in tests.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

from framework import xla_flags


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, local_device_ids: Optional[Sequence[int]] = None) -> None:
  """Starts the multi-controller runtime. With no arguments on a cluster (SLURM, TPU pod, Open MPI),
  jax auto-detects everything. On CPU the collectives backend is gloo (must be set before init).
  Pass ``local_device_ids`` under SLURM with one process per GPU (otherwise each process sees 1 GPU,
  maxtext #865 / jax #16788)."""
  import jax  # noqa: PLC0415 (jax-free at import: launch_local's parent process never imports jax)
  on_cluster = int(os.environ.get("SLURM_NTASKS", "1")) > 1 or os.environ.get("PRISMLLM_DISTRIBUTED") == "1"
  if coordinator is None and not on_cluster:
    return  # single process
  # Only affects the CPU backend (gloo collectives between processes); must precede initialize().
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kw = {}
  if coordinator is not None:
    kw.update(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
  if local_device_ids is not None:
    kw["local_device_ids"] = list(local_device_ids)
  jax.distributed.initialize(**kw)


def launch_local(argv: Sequence[str], processes: int, host_devices: int, timeout_s: float = 3600.0,
                 env: Optional[dict] = None) -> int:
  """Starts ``processes`` copies of ``python -m experiments.run argv`` on localhost that train together
  (each with host_devices/processes emulated CPU devices). Child 0's output is shown; every child is
  killed if one fails or on exit. Returns the first non-zero exit code, or 0.

  SIGINT / SIGTERM to this launcher is forwarded to every child (they stop together with a checkpoint,
  framework/stop.py) and child 0's exit code is returned once all have exited; a second signal kills them
  at once."""
  if host_devices % processes:
    raise ValueError(f"--host-devices {host_devices} is not divisible by --processes {processes}")
  port = free_port()
  procs, errs = [], []
  base_env = dict(os.environ if env is None else env)
  xla_flags.set_host_device_count(host_devices // processes, base_env)
  base_env.setdefault("JAX_PLATFORMS", "cpu")
  stop = {}

  def forward(signum, _frame):
    if stop:  # a second signal: end now (the last complete checkpoint stays; a save in flight is a temp folder)
      for p in procs:
        _killpg(p)
      raise SystemExit(128 + signum)
    stop["sig"] = signum
    for p in procs:
      if p.poll() is None:
        os.kill(p.pid, signum)
  old = {}
  if threading.current_thread() is threading.main_thread():
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    for pid in range(processes):
      cmd = [sys.executable, "-m", "experiments.run", *argv, "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", str(processes), "--process-id", str(pid)]
      # the other children's stderr goes to a file, not a pipe: a chatty child must never block on a full
      # pipe nobody reads while its peers wait for it in a collective
      errs.append(None if pid == 0 else tempfile.TemporaryFile())
      procs.append(subprocess.Popen(cmd, env=base_env, stdout=None if pid == 0 else subprocess.DEVNULL,
                                    stderr=errs[-1], start_new_session=True))
    deadline = time.time() + timeout_s
    while True:
      codes = [p.poll() for p in procs]
      if stop:  # stopping together: wait for every child's save, then report child 0's outcome
        if all(c is not None for c in codes):
          return codes[0]
        if time.time() > deadline:
          return 124
        time.sleep(0.2)
        continue
      bad = [c for c in codes if c not in (None, 0)]
      if bad:
        for i, p in enumerate(procs):
          if p.poll() not in (None, 0) and errs[i] is not None:
            errs[i].seek(0)
            sys.stderr.write(f"[process {i}] " + errs[i].read().decode(errors="replace")[-4000:])
        return bad[0]
      if all(c == 0 for c in codes):
        return 0
      if time.time() > deadline:
        return 124
      time.sleep(0.2)
  finally:
    for sig, h in old.items():
      signal.signal(sig, h)
    for p in procs:
      _killpg(p)  # gloo peers can hang after a failure: SIGTERM is not enough
      p.wait()
    for f in errs:
      if f is not None:
        f.close()


def _killpg(p: subprocess.Popen) -> None:
  if p.poll() is None:
    try:
      os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
