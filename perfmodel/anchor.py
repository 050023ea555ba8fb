"""Speed anchors: the host's current speed against the calibration, read from calibration programs.

`python -m perfmodel calibrate --anchor` re-measures ``suite.ANCHORS`` (calibration programs, about a minute) and
stores the median of (measured now / step time in the calibration) in the profile as ``speed_anchor``;
`predict` then multiplies its times by that factor (``--no-anchor``: the profile's own speed). `validate` measures
the same programs in every round itself (round_factor below), so its anchored figure needs no stored factor.

Why: a profile is fitted at the host speed of its calibration, and on a shared VM that speed moves by 10-25%
within hours (perfmodel/README.md, "Host speed", "Speed anchors"). A one-program probe did not follow it."""
from __future__ import annotations

import datetime
import json
import os
import statistics

# the time-valued fields of predict's output (tokens_per_s, mfu and decode_tokens_per_s are rates: divided);
# total_s is the generation's time in infer mode only (in train mode it is how long the prediction took)
TIME_FIELDS = ("step_time_s", "ttft_s", "tpot_s")
RATE_FIELDS = ("tokens_per_s", "mfu", "decode_tokens_per_s")


def factor(measured: dict, refs: dict):
  """(median over anchors of measured / reference, per-anchor ratios); (None, {}) without a common anchor."""
  ratios = {n: measured[n] / ref for n, ref in refs.items() if measured.get(n) and ref}
  return (statistics.median(ratios.values()), ratios) if ratios else (None, {})


def measure(hw_name: str = "cpu", reps: int = 7, rounds: int = 2) -> dict:
  """Measures the anchors in fresh one-device children (``rounds`` of them; per anchor the median over rounds)
  and returns the ``speed_anchor`` record. Raises if the profile has no calibration step times for them."""
  from perfmodel import hardware, suite, validate  # noqa: PLC0415
  hw = hardware.load(hw_name)
  refs = references(suite, hw)
  if not refs:
    raise RuntimeError(f"profile {hw.name!r} has no calibration step times for the anchors {suite.ANCHORS}: "
                       "run `python -m perfmodel calibrate` first")
  from perfmodel.rounds import with_statistic  # noqa: PLC0415
  stat = hw.calibration.get("step_statistic", "median")  # as the calibration's step times were read
  got = [validate.measure_isolated(None, list(refs), 1, reps, probe=False) for _ in range(max(1, rounds))]
  measured = {n: statistics.median(with_statistic(g[n], stat)["measured_s"] for g in got) for n in refs}
  f, ratios = factor(measured, refs)
  return {"factor": f, "ratios": {n: round(r, 4) for n, r in ratios.items()},
          "date": datetime.datetime.now().isoformat(timespec="seconds"),
          "calibration_date": hw.calibration.get("date"), "rounds": rounds,
          "source": f"python -m perfmodel calibrate --anchor: {len(refs)} calibration programs, {rounds} round(s) "
                    f"in one-device children, median of measured / calibration step time"}


def store(record: dict, prof_path: str) -> None:
  """Writes ``record`` as the profile's ``calibration.value.speed_anchor`` (everything else untouched)."""
  with open(prof_path) as f:
    base = json.load(f)
  base["calibration"]["value"]["speed_anchor"] = record
  with open(prof_path, "w") as f:
    json.dump(base, f, indent=1)


def apply(out: dict, hw) -> dict:
  """``out`` (a predict result) at the anchored speed: time fields x factor, rates / factor; the unanchored
  values kept under ``speed_anchor.unanchored``. A no-op (with the reason) when the profile has no anchor or
  the anchor belongs to an earlier calibration."""
  rec = (hw.calibration or {}).get("speed_anchor")
  if not rec or not rec.get("factor"):
    out["speed_anchor"] = {"applied": False, "reason": "no anchor in the profile (`calibrate --anchor`)"}
    return out
  if rec.get("calibration_date") != hw.calibration.get("date"):
    out["speed_anchor"] = {"applied": False, "reason": "the anchor was measured against an earlier calibration"}
    return out
  f = rec["factor"]
  fields = TIME_FIELDS + RATE_FIELDS + (("total_s",) if out.get("mode") == "infer" else ())
  unanchored = {k: out[k] for k in fields if isinstance(out.get(k), (int, float))}
  for k, v in unanchored.items():
    out[k] = v / f if k in RATE_FIELDS else v * f
  out["speed_anchor"] = {"applied": True, "factor": f, "measured": rec.get("date"), "unanchored": unanchored}
  return out


# --- per validation round (validate.run measures the anchors in every round itself) ---

def interleave(names: list, extra: list) -> list:
  """``names`` with ``extra`` spread evenly through it (first before the first name, last after the last), so
  anchors sample the host's speed across the whole measuring child, not at one end of it."""
  if not extra:
    return list(names)
  out, step = [], len(names) / max(1, len(extra) - 1)
  slots = [round(i * step) for i in range(len(extra))] if len(extra) > 1 else [0]
  for i, n in enumerate(names):
    out += [a for a, s_ in zip(extra, slots) if s_ == i] + [n]
  out += [a for a, s_ in zip(extra, slots) if s_ >= len(names)]
  return out


def references(suite, hw, kind: str = "train") -> dict:
  """{anchor name: its step time (decode: TPOT) in the calibration the profile was fitted on (at the reference
  speed)} for the suite's ANCHORS (kind "decode": ANCHORS_DECODE) the profile has (``calibration_loo[].measured_s``);
  empty when either side lacks them."""
  names = list(getattr(suite, "ANCHORS_DECODE" if kind == "decode" else "ANCHORS", []))
  cal = {r["name"]: r["measured_s"] for r in (hw.calibration or {}).get("calibration_loo", []) or []
         if r.get("type") == kind}
  return {n: cal[n] for n in names if cal.get(n)}


def round_factor(cache: dict, refs: dict):
  """How much slower (> 1) or faster (< 1) this round's host ran than the calibration: the median over the
  anchors of measured / calibration step time; None if the round has no anchor measurement. The median over 6
  programs, so one anchor caught in a noisy window does not move it (module docstring)."""
  f, ratios = factor({n: (cache.get(n) or {}).get("measured_s") for n in refs}, refs)
  return f, list(ratios.values())


def normalise(rows: list, caches: list, refs: dict, key: str = "anchored"):
  """Adds ``measured_<key>_s`` / ``err_<key>_pct`` to every row: each round's measurement divided by the
  round's anchor factor, then the median over rounds. Returns the per-round factors, or None when any round
  has no anchors."""
  if not refs or not rows:
    return None
  per_round = [round_factor(c, refs) for c in caches]
  if any(f is None for f, _ in per_round) or any(len(r["rounds"]) != len(caches) for r in rows):
    return None
  for r in rows:
    xs = [m["measured_s"] / f for m, (f, _) in zip(r["rounds"], per_round)]
    for m, x in zip(r["rounds"], xs):
      m[f"measured_{key}_s"] = x
    r[f"measured_{key}_s"] = statistics.median(xs)
    r[f"err_{key}_pct"] = 100 * (r["predicted_s"] - r[f"measured_{key}_s"]) / r[f"measured_{key}_s"]
  return {"programs": list(refs), "factor_by_round": [round(f, 4) for f, _ in per_round],
          "ratios_by_round": [[round(x, 4) for x in rs] for _, rs in per_round],
          "meaning": "median over the anchors of measured / calibration step time (> 1: host slower than at "
                     "calibration); each round's measurements are divided by its factor"}


def probe_then_normalise(rows: list, caches: list, refs: dict, ref, refs_by_devices: dict = None):
  """The second anchored figure (``err_probe_anchored_pct``): first the probe's correction of drift *within* a
  round (each measurement at the calibration's reference speed, rounds.speed_normalise), then the anchors'
  reading of how the probe's speed maps to the calibration programs' speed. Each anchor is taken to the
  reference speed with the probes pooled around it in measurement order (the cache keeps that order), exactly as
  a suite entry is. Needs every row's ``rounds[i]["measured_at_ref_s"]`` (rounds.normalise_rounds)."""
  from perfmodel.rounds import SPEED_WINDOW as window  # noqa: PLC0415
  ref1 = float((refs_by_devices or {}).get("1") or ref or 0)
  if not refs or not rows or not ref1:
    return None
  factors = []
  for c in caches:
    seq = [(n, m) for n, m in c.items() if (m.get("host_devices") or 1) == 1 and m.get("probe_s")]
    probes = [m["probe_s"] for _, m in seq]
    ratios = []
    for j, (n, m) in enumerate(seq):
      if n in refs:
        pooled = statistics.median(probes[max(0, j - window):j + window + 1])
        ratios.append(m["measured_s"] * ref1 / pooled / refs[n])
    if not ratios:
      return None
    factors.append(statistics.median(ratios))
  if any(len(r["rounds"]) != len(caches) or any("measured_at_ref_s" not in m for m in r["rounds"]) for r in rows):
    return None
  for r in rows:
    xs = [m["measured_at_ref_s"] / f for m, f in zip(r["rounds"], factors)]
    r["measured_probe_anchored_s"] = statistics.median(xs)
    m_ = r["measured_probe_anchored_s"]
    r["err_probe_anchored_pct"] = 100 * (r["predicted_s"] - m_) / m_
  return [round(f, 4) for f in factors]


def profile_path(hw_name: str) -> str:
  from perfmodel import hardware  # noqa: PLC0415
  return os.path.join(hardware.PROFILE_DIR, f"{hw_name}.json")
