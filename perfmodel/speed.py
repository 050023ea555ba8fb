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
PROBE_REPS = 5


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
    s = bench.seconds(bench.time_fn(self._run, reps=reps, warmup=1))
    self.samples.append(s)
    return s

  def around(self, fn):
    """(fn(), probe seconds): the probe timed just before and just after fn, averaged."""
    before = self.measure()
    out = fn()
    return out, 0.5 * (before + self.measure())


def reference(probe_times) -> float:
  """A calibration run's reference speed: the median of its probe times."""
  return float(statistics.median(probe_times))


def normalise(measured_s: float, probe_s, ref_s) -> float:
  """``measured_s`` expressed at the reference speed; unchanged when either probe time is missing."""
  if not probe_s or not ref_s:
    return measured_s
  return measured_s * ref_s / probe_s
