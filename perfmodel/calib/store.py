"""Writing what calibration measured: the committed profile and node data (``calibrate`` only), the user's cache
(profiling a program during ``predict`` / ``validate``). Every write goes to a temporary file in the same folder
and replaces the target in one step, so a reader (or a second writer) never sees half a file."""
from __future__ import annotations

import dataclasses

from perfmodel.compositions import Calibration
from perfmodel.cost.database import read_json, write_bytes, write_json  # noqa: F401 (calib reads and writes through these)


def calibration_of(prof_path: str) -> Calibration:
  raw = read_json(prof_path)["calibration"]
  return Calibration.from_dict(raw.get("value", raw))


def update_calibration(prof_path: str, source: str = None, **changes) -> Calibration:
  """Replaces fields of the profile's calibration (everything else in the file untouched); returns it."""
  base = read_json(prof_path)
  raw = base.get("calibration") or {"value": {}}
  cal = dataclasses.replace(Calibration.from_dict(raw.get("value", raw)), **changes)
  base["calibration"] = {"value": cal.to_dict(), "source": source or raw.get("source", "")}
  write_json(prof_path, base, indent=1)
  return cal


