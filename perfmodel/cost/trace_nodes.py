"""In-program time of every HLO instruction of a compiled CPU program, from XLA's own TraceMe events.

With ``--xla_cpu_enable_xprof_traceme=true`` (set by :func:`enable` before jax starts) XLA:CPU wraps
every thunk (fusion, dot, copy, collective, ...) in a TraceMe named after its HLO instruction; a
``jax`` profiler session collects them. This is how ``python -m perfmodel calibrate`` learns what a
fusion of given bytes / flops / transcendentals costs *inside a real program* (hot caches, no dispatch):
it runs a calibration suite of training steps (disjoint from the validation suite) and keeps one sample
per (program, instruction). Validation never uses these traces of its own configs.

The durations are wall clock within the executing thread. A thunk preempted by another process looks
longer, so each instruction's sample keeps a low quantile (p25) of its occurrences (loop trips x repeats x
virtual devices), and beside it their median and mean: calibration chooses which of the three the backends price
with (``learned.STATS``, by leave-one-program-out error) and fits how their sum relates to the step's CPU time.
"""
from __future__ import annotations

import collections
import os

from jax._src import profiler as jprof
from jax._src.lib import _profiler

TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"
_SKIP_PREFIX = ("end:", "Threadpool", "ThunkExecutor", "SlinkyThreadPool", "PjRt", "Pjit", "Common", "Handle",
                "Allocate", "Parse", "Python", "$")


def enable(env=None) -> None:
  """Makes XLA:CPU emit per-thunk TraceMe events: in ``env`` (default this process's environment, before jax
  starts its backend)."""
  env = os.environ if env is None else env
  flags = env.get("XLA_FLAGS", "")
  if TRACE_FLAG not in flags:
    env["XLA_FLAGS"] = (flags + " " + TRACE_FLAG).strip()


def traced_times(run, reps: int = 5, names: set = None) -> dict:
  """{instruction name: sorted list of durations (s)} over ``reps`` calls of ``run()`` (blocks itself).

  ``names`` restricts to known HLO instruction names (other profiler events are dropped)."""
  sess = _profiler.ProfilerSession()
  for _ in range(reps):
    run()
  xs = sess.stop()
  data = jprof.ProfileData.from_serialized_xspace(xs)
  out = collections.defaultdict(list)
  for plane in data.planes:
    for line in plane.lines:
      for ev in line.events:
        nm = ev.name
        if nm.startswith(_SKIP_PREFIX) or (names is not None and nm not in names):
          continue
        out[nm].append(ev.duration_ns * 1e-9)
  return {k: sorted(v) for k, v in out.items()}


def quantile(xs: list, q: float) -> float:
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]
