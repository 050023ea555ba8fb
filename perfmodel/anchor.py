"""Speed anchors: the host's current speed against the calibration, read from calibration programs.

`python -m perfmodel calibrate --anchor` re-measures ``suite.ANCHORS`` (calibration programs, about a minute) and
stores the median of (measured now / step time in the calibration) in the profile as ``speed_anchor``;
`predict` then multiplies its times by that factor (``--no-anchor``: the profile's own speed). `validate` measures
the same programs in every round itself (validate.anchor_factor), so its anchored figure needs no stored factor.

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
  refs = validate.anchor_references(suite, hw)
  if not refs:
    raise RuntimeError(f"profile {hw.name!r} has no calibration step times for the anchors {suite.ANCHORS}: "
                       "run `python -m perfmodel calibrate` first")
  got = [validate.measure_isolated(None, list(refs), 1, reps, probe=False) for _ in range(max(1, rounds))]
  measured = {n: statistics.median(g[n]["measured_s"] for g in got) for n in refs}
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


def profile_path(hw_name: str) -> str:
  from perfmodel import hardware  # noqa: PLC0415
  return os.path.join(hardware.PROFILE_DIR, f"{hw_name}.json")
