"""The pinned measurement regime (perfmodel/calib/bench.py times in it): one core, single-threaded XLA:CPU kernels,
process CPU time as the clock. The profiler that prices a program's instructions (perfmodel/cost/profiler.py) and
the calibration share it, so their seconds are in the same units."""
from __future__ import annotations

import os
import time

PIN_ENV = "PERFMODEL_PIN_CORE"  # set by pin(): the core this process is confined to


def pin(core: int = -1) -> int:
  """Confines this process (threads created from now on) to one core and single-threaded XLA kernels.

  Call before jax is imported: threads that already exist keep their affinity, and XLA reads its flags
  once. core=-1 picks the last allowed core. Returns the core."""
  allowed = sorted(os.sched_getaffinity(0))
  core = allowed[-1] if core < 0 else core
  if core not in allowed:
    raise ValueError(f"core {core} is not in this process's allowed set {allowed}: pass one of them to --pin-core")
  for tid in _thread_ids():
    try:
      os.sched_setaffinity(tid, {core})
    except OSError:
      pass
  os.sched_setaffinity(0, {core})
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_cpu_multi_thread_eigen" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()
  os.environ[PIN_ENV] = str(core)
  return core


def _thread_ids() -> list:
  try:
    return [int(t) for t in os.listdir("/proc/self/task")]
  except OSError:
    return []


def pinned() -> bool:
  return len(os.sched_getaffinity(0)) == 1


def clock():
  """The regime's clock as a function: process CPU time when pinned, else wall time."""
  return time.process_time if pinned() else time.perf_counter


def boot_id() -> str:
  """The kernel's id of this boot (Linux; None elsewhere). Measurements of one boot share one machine state; across
  boots (a new machine of the same kind) a host's speeds move by double-digit percentages, so every measurement records
  it (the profiled database re-times another boot's entries; the host floor groups sets by it)."""
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return None
