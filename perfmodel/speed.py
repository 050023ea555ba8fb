"""Host-speed probe: one fixed small training step, timed back-to-back with every measured program.

Why: this host is a VM on shared hardware. Its speed drifts over minutes even with the process pinned and
timed in CPU time (steal time stays ~0, so the drift is shared caches / memory bandwidth / clocks, not
lost CPU time). Measured: the 23 calibration programs re-measured 40 minutes after a calibration, by the
same code in the same kind of process, ran a median 12.5% slower (0.88x-1.45x per program). A model
calibrated at one speed and compared with measurements taken at another carries that drift as error.

So `calibrate` and `validate` time the probe just before and just after each program and keep its time
with the measurement. Calibration stores the median probe time of its run as the profile's reference speed
(``speed_probe_ref_s``) and fits the step composition on every calibration program's step taken at that
speed, ``measured * ref / probe`` (the drift inside one 4-minute calibration run reached 20%; with the
correction the leave-one-program-out error went from 16.9% to 8.6%). `validate` keeps the raw measurement as
its headline and reports, beside it, the error at the reference speed (``mape_speed_normalised``, probe times
pooled over neighbouring measurements: one probe pair is as noisy as any single measurement) and the host's
speed relative to calibration (``speed_vs_calibration``).

The probe is the validation suite's BASE config (d_model 128, 2 layers, seq 64, batch 8; ~35 ms): a real
training step, so its mix of matmuls and memory-bound fusions drifts like the programs it brackets.
"""
from __future__ import annotations

import statistics

from perfmodel import bench

PROBE_NAME = "speed_probe"
PROBE_REPS = 10  # 10 calls, so the p10 statistic is not simply the minimum of five


class Probe:
  """Compiles the probe step once per process; :meth:`measure` returns its median step (regime clock)."""

  def __init__(self):
    from framework.config import from_dict, validate as validate_cfg  # noqa: PLC0415
    from perfmodel import capture, suite  # noqa: PLC0415
    from perfmodel.validate import _merge, train_runner  # noqa: PLC0415
    cfg = validate_cfg(from_dict(_merge(suite.BASE, {})), 1)
    cfg = cfg.__class__(**{**cfg.__dict__, "name": PROBE_NAME})
    cap = capture.train_step(cfg, keep_compiled=True)
    self._run = train_runner(cap, cfg)
    self.samples: list = []

  def measure(self, reps: int = PROBE_REPS) -> float:
    """The probe's median step; every statistic of this timing (bench.STATISTICS) is kept in ``last``."""
    r = bench.time_fn(self._run, reps=reps, warmup=1)
    self.last = {st: bench.seconds(r, stat=st) for st in bench.STATISTICS}
    self.samples.append(self.last["median"])
    return self.last["median"]

  def around(self, fn):
    """(fn(), {statistic: probe seconds}): the probe timed just before and just after fn, averaged, in every
    statistic (a measurement is read in one of them, and its probe must be read in the same one)."""
    self.measure()
    before = self.last
    out = fn()
    self.measure()
    return out, {st: 0.5 * (before[st] + self.last[st]) for st in bench.STATISTICS}


def one_device_probe(reps: int = 2 * PROBE_REPS) -> dict:
  """The probe timed in a fresh process with exactly one virtual device (``python -m perfmodel.speed
  --probe-child``): the host's speed at this moment, free of the device count of the process measuring;
  {statistic: seconds}."""
  from perfmodel.validate import child_json  # noqa: PLC0415
  got = child_json("perfmodel.speed", "--probe-child", {"reps": reps}, 1, "speed probe child")
  return {st: float(got[st]) for st in bench.STATISTICS}


def device_references(ref_1: float, probes: dict, windows: dict) -> dict:
  """{device count: reference probe time}. ``probes``: {N: probe times timed in the N-device measuring
  child}; ``windows``: {N: one-device probe times taken just before and after that child}.

  The probe in an N-device process is slower than in a one-device one (idle virtual devices), and a whole
  child may also run in a slow window of the host. Taking the median of the child's own probes as its
  reference would hide the second (calibration of 2026-11-30 19:55: the 4-device child's probe was 1.35x the one-device
  reference, 1.19x in the calibration before; its two programs came out 1.8x slower than the others and the
  fitted collective term 7x too large). So the device factor is measured against the host's speed in that
  window, and the reference is the one-device reference times that factor. The one-device child is bracketed
  too, so a fresh process's probe and a measuring child's probe need not agree: only ratios of windows enter."""
  out = {1: ref_1}
  w1 = windows.get(1)
  for n, ps in probes.items():
    if n == 1:
      continue
    w = windows.get(n)
    if w and w1:
      factor = (statistics.median(ps) / statistics.median(w)) / (statistics.median(probes[1]) / statistics.median(w1))
      out[n] = ref_1 * factor
    else:  # no windows (older step times): the child's own median, as before
      out[n] = statistics.median(ps)
  return out


def reference(probe_times) -> float:
  """A calibration run's reference speed: the median of its probe times."""
  return float(statistics.median(probe_times))


def normalise(measured_s: float, probe_s, ref_s) -> float:
  """``measured_s`` expressed at the reference speed; unchanged when either probe time is missing."""
  if not probe_s or not ref_s:
    return measured_s
  return measured_s * ref_s / probe_s


if __name__ == "__main__":
  import json  # noqa: PLC0415
  import sys  # noqa: PLC0415
  if len(sys.argv) == 4 and sys.argv[1] == "--probe-child":
    from framework import host_memory  # noqa: PLC0415
    host_memory.apply()  # as the measuring children do, before jax starts
    req = json.loads(sys.argv[3])
    probe = Probe()
    probe.measure(reps=2)  # warm
    probe.measure(reps=int(req.get("reps", 2 * PROBE_REPS)))
    with open(sys.argv[2], "w") as f:
      json.dump(probe.last, f)
    sys.exit(0)
  sys.exit("usage: python -m perfmodel.speed --probe-child OUT JSON (run by perfmodel calibrate)")
