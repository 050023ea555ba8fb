"""Co-located ranks' interference, replayed: shadow processes that run a rank's computation on the other cores
while the real rank is timed.

Why: on a GPU cluster every rank owns its device, so one rank timed alone is timed faithfully. On a CPU host
the target job's ranks are processes on cores that share the last-level cache and DRAM; a rank timed alone on
an otherwise idle host runs faster than the same rank in the real job, where its co-located peers stream
their own activations and weights through the same memory system at the same time (measured here: a
memory-bound step on one core slows by 10-40% when another core runs a memory-bound job). The virtual peers
that would share this host in the target job are therefore replayed as load: each shadow process builds the
same per-rank stand-in program (perfmodel/emulate/rank_program.py, identical shapes), pins itself to its own
core and runs steps back to back until the measurement ends. Shadows are load, not ranks: they compute
nothing the emulation reads, and their collectives are the local stand-ins.

  with shadow.Shadows(cfg, rank=0, cores=[1]):   # returns once every shadow is compiled and stepping
    ... time the real rank on core 0 ...

  python -m perfmodel.emulate.shadow CONFIG_JSON RANK CORE [--lockstep]   # the child (stops when stdin closes;
                                                                           # --lockstep: one step per stdin line)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

from perfmodel.emulate import localrun

READY = "@@shadow-ready"


def colocated_cores(n_ranks_on_host: int) -> list:
  """Cores for the shadows of ``n_ranks_on_host - 1`` co-located peers: the allowed cores other than the
  measuring process's own (its affinity's first core), as many as there are."""
  allowed = sorted(os.sched_getaffinity(0))
  mine = allowed[0]
  others = [c for c in range(os.cpu_count() or 1) if c != mine]
  return others[:max(0, n_ranks_on_host - 1)]


class Shadows:
  """Context manager: ``len(cores)`` shadow processes running ``rank``'s program, one per core."""

  def __init__(self, cfg, rank: int, cores: Sequence[int], timeout_s: float = 600.0, lockstep: bool = False):
    self.cfg, self.rank, self.cores, self.timeout_s = cfg, rank, list(cores), timeout_s
    # lockstep: each shadow runs one step per :meth:`step` call instead of back to back, so its step starts
    # with the measured rank's (in the real job the ranks leave each synchronising collective together, and
    # their memory-bound phases coincide)
    self.lockstep = lockstep
    self.procs, self.errs = [], []
    self.ready_s = None

  def __enter__(self):
    from framework import config as config_lib  # noqa: PLC0415 (loads numpy: see _child)
    blob = json.dumps(config_lib.to_dict(self.cfg))
    env = localrun.base_env(1)
    t0 = time.perf_counter()
    try:
      for core in self.cores:
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "perfmodel.emulate.shadow", blob, str(self.rank), str(core)]
            + (["--lockstep"] if self.lockstep else []), env=env,
            cwd=localrun._root(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr(),  # noqa: SLF001
            text=True, start_new_session=True))
      for p, err in zip(self.procs, self.errs):
        self._wait_ready(p, err, t0)
    except BaseException:
      self._kill()
      raise
    self.ready_s = time.perf_counter() - t0
    return self

  def _stderr(self):
    # a file, not a pipe: nobody reads a running shadow's stderr, and a full pipe would stall the shadow
    f = tempfile.TemporaryFile("w+")
    self.errs.append(f)
    return f

  def _wait_ready(self, p, err_file, t0):
    ready = threading.Event()

    def read():  # keeps draining stdout after the READY line, for the same reason as stderr goes to a file
      for line in p.stdout:
        if line.startswith(READY):
          ready.set()
    threading.Thread(target=read, daemon=True).start()
    ready.wait(max(1.0, self.timeout_s - (time.perf_counter() - t0)))
    if not ready.is_set():
      err = localrun.read_back(err_file)[-2000:] if p.poll() is not None else "(still compiling)"
      raise RuntimeError(f"shadow process for rank {self.rank} did not start within {self.timeout_s:.0f} s: {err}")

  def step(self) -> None:
    """Lockstep mode: starts one step in every shadow (a shadow still busy queues it)."""
    if not self.lockstep:
      return
    for p in self.procs:
      p.stdin.write("s\n")
      p.stdin.flush()

  def _kill(self):
    for p in self.procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      try:
        if p.stdin:
          p.stdin.close()
        p.wait(timeout=10)
      except Exception:  # noqa: BLE001 - best effort: the group is already killed
        pass
    for f in self.errs:
      f.close()
    self.procs, self.errs = [], []

  def __exit__(self, *exc):
    self._kill()
    return False


def _child(blob: str, rank: int, core: int, lockstep: bool = False) -> None:
  os.sched_setaffinity(0, {core})  # before jax starts: its threads inherit the mask
  from framework import config as config_lib  # noqa: PLC0415 (after the affinity mask: numpy's threads inherit it)
  from perfmodel.emulate import measure, rank_program as rp  # noqa: PLC0415 (after the affinity mask: jax's threads inherit it)
  cfg = config_lib.from_dict(json.loads(blob))
  prog = rp.build(cfg)
  compiled, _, _ = measure.compile_rank(prog, rank)
  state = rp.random_state(prog, 0)
  inputs, targets = rp.random_batch(prog, 1)
  state, loss = compiled(state, inputs, targets)
  float(loss)
  print(READY, flush=True)
  if lockstep:  # one step per line on stdin, until it closes
    for _ in sys.stdin:
      state, loss = compiled(state, inputs, targets)
      float(loss)
    return
  stop = threading.Event()
  threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
  while not stop.is_set():
    state, loss = compiled(state, inputs, targets)
    float(loss)


if __name__ == "__main__":
  from framework import host_memory
  host_memory.apply()  # the regime of the rank it stands beside
  _child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), lockstep="--lockstep" in sys.argv[4:])
