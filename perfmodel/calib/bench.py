"""The one place programs are timed: medians and low quantiles with spread, in wall time AND process CPU time, and
the *pinned* measurement regime that makes them repeatable on a shared host.

The regime (perfmodel/cost/regime.py ``pin()``, called by the CLI before jax starts) confines the process to one core with
``os.sched_setaffinity`` and turns off XLA:CPU's multi-threaded Eigen kernels
(``--xla_cpu_multi_thread_eigen=false``; jax 0.10.2 accepts it). Then every thread of the process —
the XLA executor and the threads of all virtual devices — runs on that one core, and the process's
CPU time (``time.process_time``: all threads, user + system) counts the work done, not the time other
users' processes held the core. On a machine shared with other engineers wall time of even a pinned
run stretches by the run-queue share; CPU time does not. Predictions in the ``cpu`` profile are in
these units: seconds of one core's work (perfmodel/README.md, "Calibration and validation"). jax is imported inside
the timing functions: ``pin()`` must run before jax loads.
"""
from __future__ import annotations

import os
import statistics
import time

from framework import host_memory
from perfmodel.cost.regime import boot_id, clock, pinned


def regime() -> dict:
  """What the numbers of this process mean (recorded with every calibration and validation)."""
  return {"pinned_core": sorted(os.sched_getaffinity(0))[0] if pinned() else None,
          "allowed_cores": len(os.sched_getaffinity(0)),
          "xla_multi_thread_eigen": "--xla_cpu_multi_thread_eigen=false" not in os.environ.get("XLA_FLAGS", ""),
          "load_avg_1m": os.getloadavg()[0], "host_malloc": host_memory.state(), "boot_id": boot_id()}


def _stats(ts: list) -> dict:
  ts = sorted(ts)
  return {"median": statistics.median(ts), "p10": ts[len(ts) // 10], "p90": ts[min(len(ts) - 1, (9 * len(ts)) // 10)],
          "min": ts[0], "n": len(ts)}


def time_fn(fn, *args, reps: int = 7, warmup: int = 2, min_time: float = 0.0, max_reps: int = 200) -> dict:
  """Times fn(*args) (blocked until ready), repeating while under min_time.

  Returns the wall-clock stats at the top level (``median``, ``p10``, ``p90``, ``min``, ``n``) and the
  process-CPU-time stats under ``"cpu"``; ``"clock"`` says which one the top level is — callers use
  :func:`seconds` to read the clock of the regime."""
  import jax  # noqa: PLC0415 (pin() runs before jax loads)
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  wall, cpu = [], []
  t_start = time.perf_counter()
  while len(wall) < reps or (time.perf_counter() - t_start < min_time and len(wall) < max_reps):
    c, t = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn(*args))
    wall.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
  out = _stats(wall)
  out["cpu"] = _stats(cpu)
  out["clock"] = "wall"
  return out


def time_slope(fn1, fn2, x1: float, x2: float, reps: int = 9, block: int = 4, min_time: float = 0.0,
               max_reps: int = 200) -> dict:
  """The per-unit cost (t(fn2) - t(fn1)) / (x2 - x1), e.g. the time per output token of a sampler run at two
  generation lengths. Timed in alternating blocks: per round, fn1 then fn2 each run once untimed and ``block``
  times timed; one slope per round from the two blocks' medians; stats over rounds (same layout as time_fn).

  Why blocks: a slope is the difference of two close numbers. Timing all fn1 calls and then all fn2 calls lets
  the host's drift between the two lands in the difference (decode TPOT moved 10-25% between runs that way).
  Why not single alternating calls: the first call after switching programs is measured 1.3-2.2 ms slower here
  (decode_b4: 6.0-7.0 vs 4.7-4.8 ms), which is not the steady-state cost per token."""
  import jax  # noqa: PLC0415 (pin() runs before jax loads)
  wall, cpu = [], []
  calls_w, calls_c = ([], []), ([], [])  # every timed call of fn1 / fn2, for the low-quantile slope
  t_start = time.perf_counter()
  while len(wall) < reps or (time.perf_counter() - t_start < min_time and len(wall) < max_reps):
    meds_w, meds_c = [], []
    for i, fn in enumerate((fn1, fn2)):
      jax.block_until_ready(fn())
      ws, cs = [], []
      for _ in range(block):
        c, t = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn())
        ws.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
      meds_w.append(statistics.median(ws))
      meds_c.append(statistics.median(cs))
      calls_w[i].extend(ws)
      calls_c[i].extend(cs)
    wall.append((meds_w[1] - meds_w[0]) / (x2 - x1))
    cpu.append((meds_c[1] - meds_c[0]) / (x2 - x1))
  out = _stats(wall)
  out["cpu"] = _stats(cpu)
  # p10 statistic of a slope: the difference of the two programs' p10 call times (not the p10 of per-round
  # slopes, which is a tail of a difference and biased low)
  out["slope_of_p10"] = (_stats(calls_w[1])["p10"] - _stats(calls_w[0])["p10"]) / (x2 - x1)
  out["cpu"]["slope_of_p10"] = (_stats(calls_c[1])["p10"] - _stats(calls_c[0])["p10"]) / (x2 - x1)
  out["clock"] = "wall"
  return out


def time_interleaved(fns, args=(), reps: int = 7) -> list:
  """Median wall seconds of each of ``fns(*args)`` (each run once first), the functions run in turn ``reps``
  times, so a drift of the host hits every variant alike."""
  import jax  # noqa: PLC0415 (pin() runs before jax loads)
  for f in fns:
    jax.block_until_ready(f(*args))
  ts = [[] for _ in fns]
  for _ in range(reps):
    for f, t in zip(fns, ts):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      t.append(time.perf_counter() - t0)
  return [statistics.median(t) for t in ts]


# Statistics a step time can be read as (perfmodel/calib/host.py): the median of the timed calls, or their 10th
# percentile. A profile records the one its compositions were fitted on (``Calibration.step_statistic``) and
# `validate` reads measurements in it.
STATISTICS = ("median", "p10")


def seconds(r: dict, clock: str = "auto", stat: str = "median") -> float:
  """A time_fn / time_slope result in the regime's clock (CPU time when pinned, auto; else wall) as ``stat``:
  the median, or the 10th percentile of the timed calls (of a slope: the slope between the two programs' p10s)."""
  v = view(r, clock)
  if stat == "median":
    return v["median"]
  if stat == "p10":
    return v.get("slope_of_p10", v["p10"])
  raise ValueError(f"unknown statistic {stat!r}: one of {STATISTICS}")


def view(r: dict, clock: str = "auto") -> dict:
  """The stats of one clock (the sub-dict time_fn returns for it)."""
  if clock == "auto":
    clock = "cpu" if pinned() else "wall"
  return r["cpu"] if clock == "cpu" else {k: r[k] for k in ("median", "p10", "p90", "min", "n", "slope_of_p10")
                                          if k in r}


def spread_pct(r: dict) -> float:
  """Half the p10-p90 range as a percent of the median: the run-to-run noise we report."""
  return 50.0 * (r["p90"] - r["p10"]) / r["median"] if r["median"] else 0.0
