"""Measurement rounds of `validate`: pooling rounds into one figure per config, and speed normalisation.

A stored measurements file holds several rounds (`validate --rounds N`); each config's figure is the median of
the rounds' medians. Each round is normalised to the calibration's reference speed on its own, from the speed
probes timed beside its measurements (perfmodel/speed.py), so a drifting host shows up as drift, not as error.
Moved out of perfmodel/validate.py (session 24) to keep that module about running a suite.
"""
from __future__ import annotations

import json
import statistics


def load_rounds(path: str) -> list:
  """The measurement rounds stored in ``path``: a file from before rounds (one {name: measurement}) is one."""
  with open(path) as f:
    d = json.load(f)
  if "rounds" in d and isinstance(d["rounds"], list):
    return d["rounds"]
  return [d]


def with_statistic(m: dict, stat: str) -> dict:
  """One measurement read in statistic ``stat`` (bench.STATISTICS): the median is its top level, the p10 reading
  (measured since session 28) replaces measured_s / noise_pct / rounds_s / probe_s (and the one-device window
  probes of a calibration child) with its own. Raises for a p10 reading of a measurement taken before it existed:
  mixing statistics would put the host's contention back into the comparison."""
  if stat == "median":
    return m
  if stat not in m:
    raise ValueError(f"this measurement has no {stat!r} reading (taken before session 28?): re-measure it, or "
                     f"compare it with a profile whose step_statistic is 'median'")
  return {**m, **m[stat], "statistic": stat}


def round_spread_by_statistic(caches: list, train: list, infer: list) -> dict:
  """{statistic: {"train": .., "tpot": ..}}: the median over configs of the spread between rounds ((max - min) /
  median, percent) of each reading the rounds have for every config. How reproducible each statistic is on the
  host of these rounds, side by side on the same calls; None with fewer than two rounds."""
  from perfmodel.bench import STATISTICS  # noqa: PLC0415
  if len(caches) < 2:
    return None
  out = {}
  for stat in STATISTICS:
    by_kind = {}
    for kind, names in (("train", train), ("tpot", infer)):
      spreads = []
      for n in names:
        ms = [c.get(n) for c in caches]
        if any(m is None or (stat != "median" and stat not in m) for m in ms):
          break
        xs = [with_statistic(m, stat)["measured_s"] for m in ms]
        med = statistics.median(xs)
        spreads.append(100 * (max(xs) - min(xs)) / med if med > 0 else 0.0)
      else:
        if spreads:
          by_kind[kind] = float(statistics.median(spreads))
    if by_kind:
      out[stat] = by_kind
  return out


def pool_rounds(ms: list) -> dict:
  """One config's measurement over rounds: the median of the rounds' medians; noise = the larger of the rounds'
  median noise and half the spread between rounds. ``rounds`` keeps each round's raw measurement."""
  xs = [m["measured_s"] for m in ms]
  med = statistics.median(xs)
  spread = 100 * (max(xs) - min(xs)) / med if med > 0 else 0.0
  return {"measured_s": med, "noise_pct": max(statistics.median(m["noise_pct"] for m in ms), spread / 2),
          "wall_s": statistics.median(m.get("wall_s", m["measured_s"]) for m in ms),
          "probe_s": ms[0].get("probe_s") if len(ms) == 1 else None, "host_devices": ms[0].get("host_devices"),
          "round_spread_pct": spread,
          "rounds": [{k: m.get(k) for k in ("measured_s", "noise_pct", "probe_s", "host_devices")} for m in ms]}


def normalise_rounds(rows: list, ref, refs_by_devices: dict = None) -> bool:
  """Speed-normalises each round on its own (its probes, its measurement order: :func:`speed_normalise`) and
  gives every row the median over rounds (``measured_at_ref_s``, ``err_at_ref_pct``; per round in
  ``rounds[i]["measured_at_ref_s"]``)."""
  n_rounds = len(rows[0]["rounds"]) if rows else 0
  if not n_rounds or any(len(r["rounds"]) != n_rounds for r in rows):
    return False
  per_round = []
  for i in range(n_rounds):
    rr = [dict(r["rounds"][i], predicted_s=r["predicted_s"]) for r in rows]
    if not speed_normalise(rr, ref, refs_by_devices):
      return False
    per_round.append(rr)
  for j, r in enumerate(rows):
    for i in range(n_rounds):
      r["rounds"][i]["measured_at_ref_s"] = per_round[i][j]["measured_at_ref_s"]
    r["measured_at_ref_s"] = statistics.median(pr[j]["measured_at_ref_s"] for pr in per_round)
    r["err_at_ref_pct"] = 100 * (r["predicted_s"] - r["measured_at_ref_s"]) / r["measured_at_ref_s"]
  return True


SPEED_WINDOW = 4  # probe times of this many measurements either side are pooled (median) per measurement


def speed_normalise(rows: list, ref, refs_by_devices: dict = None) -> bool:
  """Adds ``measured_at_ref_s`` / ``err_at_ref_pct`` to every row: the measurement at the calibration's
  reference speed (perfmodel/speed.py), using the median probe time of the rows measured around it (in
  row order = measurement order). The drift being corrected is slow (minutes); one probe pair is as noisy
  as any single measurement (+-6-10%), so pooling neighbours keeps the correction from adding noise.

  ``refs_by_devices``: {host device count: reference}. Rows measured in a child with N virtual devices carry
  probes timed there (slower with more idle devices), so they are pooled and scaled within their own count."""
  if not ref or not rows or not all(r.get("probe_s") for r in rows):
    return False
  refs = {int(k): v for k, v in (refs_by_devices or {}).items()}
  groups = {}
  for r in rows:
    groups.setdefault(r.get("host_devices") if refs else None, []).append(r)
  for n, group in groups.items():
    probes = [r["probe_s"] for r in group]
    for i, r in enumerate(group):
      pooled = statistics.median(probes[max(0, i - SPEED_WINDOW):i + SPEED_WINDOW + 1])
      r["measured_at_ref_s"] = r["measured_s"] * refs.get(n, ref) / pooled
      r["err_at_ref_pct"] = 100 * (r["predicted_s"] - r["measured_at_ref_s"]) / r["measured_at_ref_s"]
  return True
