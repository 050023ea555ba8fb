"""The host's speed, in one place: the measurement side of the model on a shared machine (never on the prediction
path).

A CPU host shared with other tenants does not run a program at one speed. Three things follow, all here, behind
:class:`HostSpeed`:

* **which reading of a timed step** counts (``statistic``): the median of the timed calls, or their 10th percentile.
  Other tenants only ever add time, so the p10 is the step with the least contention and repeats far better than
  the median. A calibration records the reading its compositions were fitted on (``Calibration.step_statistic``) and
  validation reads every measurement in it; a measurement without that reading is refused, never mixed.
* **rounds**: a set measures the suite several times; a config's figure is the median of its rounds, its noise the
  larger of the rounds' noise and half their spread.
* **the probe**: during calibration a fixed small training step (the suite's BASE config) is timed just before and
  after every program, and the programs' steps are fitted at the run's median probe speed (the reference stored in
  the profile), each measuring child set against one-device probes in fresh processes around it.

And what a *perfect* model would score on this host (:meth:`HostSpeed.floor`): each round predicted by the median
of the set's other rounds (between stored sets: :meth:`HostSpeed.floor_between`). Validation reports it beside its
error: a model is not better than the host repeats itself.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import statistics

import numpy as np

from perfmodel import program
from perfmodel.calib import bench, runners

PROBE_NAME = "speed_probe"
PROBE_REPS = 10  # 10 calls, so the p10 statistic is not simply the minimum of five


class _Probe:
  """The probe step compiled once per process (:meth:`HostSpeed.probe`); :meth:`around` times it before and after a
  measurement."""

  def __init__(self):
    cfg, _, _ = runners.entry_cfg({"name": PROBE_NAME})
    self._run = runners.train_runner(program.train_step(cfg, keep_compiled=True), cfg)
    self.last: dict = {}

  def measure(self, reps: int = PROBE_REPS) -> dict:
    """{statistic: seconds} of one timing of the probe."""
    r = bench.time_fn(self._run, reps=reps, warmup=1)
    self.last = {st: bench.seconds(r, stat=st) for st in bench.STATISTICS}
    return self.last

  def around(self, fn):
    """(fn(), {statistic: probe seconds}): the probe timed just before and just after fn, averaged."""
    before = self.measure()
    out = fn()
    after = self.measure()
    return out, {st: 0.5 * (before[st] + after[st]) for st in bench.STATISTICS}


def kendall_tau(a, b) -> float:
  """Kendall's tau between two rankings of the same items (how validation scores a model's ranking)."""
  n, s = len(a), 0
  for i in range(n):
    for j in range(i + 1, n):
      s += np.sign(a[i] - a[j]) * np.sign(b[i] - b[j])
  return float(2 * s / (n * (n - 1))) if n > 1 else 1.0


def mape(pred: dict, meas: dict, names) -> float:
  """Mean absolute percentage error of ``pred`` against ``meas`` over the ``names`` both have (NaN: none)."""
  names = [n for n in names if n in pred and n in meas]
  return statistics.mean(abs(pred[n] / meas[n] - 1) * 100 for n in names) if names else float("nan")


class HostSpeed:
  def __init__(self, statistic: str = "median"):
    if statistic not in bench.STATISTICS:
      raise ValueError(f"unknown statistic {statistic!r}: one of {bench.STATISTICS}")
    self.statistic = statistic

  # ---------------------------------------------------------------- reading measurements

  def read(self, m: dict) -> dict:
    """One measurement in this statistic: the median is its top level, another reading replaces measured_s /
    noise_pct / rounds_s / probe_s (and the calibration's window probes) with its own."""
    if self.statistic == "median":
      return m
    if self.statistic not in m:
      raise ValueError(f"this measurement has no {self.statistic!r} reading: re-measure it, or compare it with a "
                       f"profile whose step_statistic is 'median'")
    return {**m, **m[self.statistic], "statistic": self.statistic}

  def has(self, rounds: list) -> bool:
    return self.statistic == "median" or all(self.statistic in m for r in rounds for m in r.values())

  @staticmethod
  def load(path: str) -> list:
    """The measurement rounds stored in ``path`` ({"rounds": [...]} or one {name: measurement})."""
    with open(path) as f:
      d = json.load(f)
    return d["rounds"] if isinstance(d.get("rounds"), list) else [d]

  def pool(self, ms: list) -> dict:
    """One config's measurement over rounds (each already read): the median of the rounds; noise = the larger of
    the rounds' median noise and half the spread between them."""
    xs = [m["measured_s"] for m in ms]
    med = statistics.median(xs)
    spread = 100 * (max(xs) - min(xs)) / med if med > 0 else 0.0
    return {"measured_s": med, "noise_pct": max(statistics.median(m["noise_pct"] for m in ms), spread / 2),
            "wall_s": statistics.median(m.get("wall_s", m["measured_s"]) for m in ms),
            "host_devices": ms[0].get("host_devices"), "round_spread_pct": spread,
            "rounds": [{k: m.get(k) for k in ("measured_s", "noise_pct", "host_devices")} for m in ms]}

  # ---------------------------------------------------------------- what a perfect model scores

  def floor(self, rounds: list, train: list, infer: list) -> dict:
    """Each round (already read) predicted by the median of the other rounds, scored as validation scores a model
    (MAPE over the training configs, and over the decode configs' TPOT); None with fewer than two rounds."""
    if len(rounds) < 2:
      return None
    errs = {"train_mape": [], "tpot_mape": []}
    for i, r in enumerate(rounds):
      others = [o for j, o in enumerate(rounds) if j != i]
      pred = {n: statistics.median(o[n]["measured_s"] for o in others if n in o) for n in r
              if any(n in o for o in others)}
      meas = {n: m["measured_s"] for n, m in r.items()}
      errs["train_mape"].append(mape(pred, meas, train))
      errs["tpot_mape"].append(mape(pred, meas, infer))
    out = {k: statistics.mean(v) if not any(math.isnan(x) for x in v) else None for k, v in errs.items()}
    out["meaning"] = "each round predicted by the median of the set's other rounds: what a perfect model scores"
    return out

  def floor_between(self, paths: list, train: list, infer: list) -> dict:
    """Set A's medians predicting set B's, for every ordered pair of stored sets that have this reading (sets
    measured on one boot, and on different ones, apart)."""
    sets = {}
    for p in paths:
      rounds = self.load(p)
      if self.has(rounds):
        rounds = [{n: self.read(m) for n, m in r.items()} for r in rounds]
        boots = {m.get("regime", {}).get("boot_id") for r in rounds for m in r.values()} - {None}
        med = {n: statistics.median(r[n]["measured_s"] for r in rounds if n in r) for n in set().union(*rounds)}
        sets[os.path.basename(p)] = (med, boots.pop() if len(boots) == 1 else None, rounds)
    pairs = []
    for a, b in itertools.permutations(sets, 2):
      (ma, ha, _), (mb, hb, _) = sets[a], sets[b]
      names = [n for n in train if n in ma and n in mb]
      pairs.append({"reference": a, "target": b, "same_boot": ha is not None and ha == hb,
                    "train_mape": mape(ma, mb, train), "tpot_mape": mape(ma, mb, infer),
                    "train_tau": kendall_tau([ma[n] for n in names], [mb[n] for n in names])})

    def pooled(same):
      sel = [p for p in pairs if p["same_boot"] == same]
      return {k: statistics.median(p[k] for p in sel) for k in ("train_mape", "tpot_mape", "train_tau")} | {
          "ordered_pairs": len(sel)} if sel else None
    return {"statistic": self.statistic, "sets": sorted(sets), "pairs": pairs,
            "within_set": {k: self.floor(v[2], train, infer) for k, v in sets.items()},
            "same_boot": pooled(True), "other_boot": pooled(False)}

  # ---------------------------------------------------------------- calibration: the probe's reference speed

  @staticmethod
  def probe() -> _Probe:
    """The probe, compiled in this process (whose device count it then carries)."""
    return _Probe()

  @staticmethod
  def one_device_probe(reps: int = 2 * PROBE_REPS) -> dict:
    """The probe timed in a fresh process with exactly one virtual device: the host's speed at this moment, free
    of the device count of the process measuring; {statistic: seconds}."""
    got = runners.child_json("probe", {"reps": reps}, 1, "speed probe child")
    return {st: float(got[st]) for st in bench.STATISTICS}

  @staticmethod
  def device_references(ref_1: float, probes: dict, windows: dict) -> dict:
    """{device count: reference probe time}. ``probes``: {N: probe times timed in the N-device measuring child};
    ``windows``: {N: one-device probe times taken just before and after that child}.

    The probe in an N-device process is slower than in a one-device one (idle virtual devices), and a whole child
    may also run in a slow window of the host; taking the child's own median probe as its reference would hide the
    second. So the device factor is measured against the host's speed in that window, and the reference is the
    one-device reference times that factor."""
    out = {1: ref_1}
    w1 = windows.get(1)
    for n, ps in probes.items():
      if n == 1:
        continue
      w = windows.get(n)
      if w and w1:
        factor = (statistics.median(ps) / statistics.median(w)) / (statistics.median(probes[1])
                                                                   / statistics.median(w1))
        out[n] = ref_1 * factor
      else:
        out[n] = statistics.median(ps)
    return out

  def calibration_steps(self, rounds: list) -> tuple:
    """(step times, one-device reference, {device count: reference}, {device count: windows}) from one or more
    rounds of calibration-program measurements ({name: measurement read in this statistic, with ``probe_s``,
    ``host_devices`` and ``window_probe_1dev_s``}).

    Every program's step is taken at the median probe speed of all rounds (the profile's reference speed), each
    round with one reference per device count (:meth:`device_references`); a program's step is then the median over
    rounds of its normalised times, its noise the larger of the rounds' median noise and half their spread."""
    one_dev = [v["probe_s"] for r in rounds for v in r.values() if v.get("probe_s") and v.get("host_devices", 1) == 1]
    ref = float(statistics.median(one_dev)) if one_dev else None
    per_round_refs, all_windows = [], {}
    for r in rounds:
      probes, windows = {}, {}
      for v in r.values():
        if v.get("probe_s"):
          probes.setdefault(v.get("host_devices", 1), []).append(v["probe_s"])
        if v.get("window_probe_1dev_s"):
          windows[v.get("host_devices", 1)] = v["window_probe_1dev_s"]
      refs = self.device_references(ref, probes, windows) if ref and 1 in probes else {}
      per_round_refs.append(refs)
      for n, w in windows.items():
        all_windows.setdefault(n, []).extend(w)
      for v in r.values():
        v["measured_raw_s"] = v["measured_s"]
        r_n = refs.get(v.get("host_devices", 1))
        if v.get("probe_s") and r_n:
          v["measured_s"] = v["measured_s"] * r_n / v["probe_s"]
    out = {}
    for name in rounds[0]:
      ms = [r[name] for r in rounds if name in r]
      xs = [m["measured_s"] for m in ms]
      med = statistics.median(xs)
      spread = 100 * (max(xs) - min(xs)) / med if med > 0 else 0.0
      out[name] = {**ms[0], "measured_s": med, "measured_raw_s": statistics.median(m["measured_raw_s"] for m in ms),
                   "noise_pct": max(statistics.median(m["noise_pct"] for m in ms), spread / 2),
                   "probe_s": statistics.median(m["probe_s"] for m in ms) if all(m.get("probe_s") for m in ms)
                   else None, "round_spread_pct": spread, "rounds": [m["measured_s"] for m in ms]}
    devices = {n for refs in per_round_refs for n in refs}
    refs = {n: statistics.median(rr[n] for rr in per_round_refs if n in rr) for n in devices}
    return out, ref, refs, all_windows
