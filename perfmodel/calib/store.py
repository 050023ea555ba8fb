"""Writing what calibration measured: the committed profile and node data (``calibrate`` only), the user's cache
(profiling a program during ``predict`` / ``validate``). Every write goes to a temporary file in the same folder
and replaces the target in one step, so a reader (or a second writer) never sees half a file."""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile

from perfmodel.calibration import Calibration


def write_bytes(path: str, data: bytes) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(os.path.abspath(path)))
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def write_json(path: str, obj, **dump_kw) -> None:
  write_bytes(path, json.dumps(obj, **dump_kw).encode())


def read_json(path: str, default=None):
  if not os.path.exists(path):
    return default
  with open(path) as f:
    return json.load(f)


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


def merge_entries(path: str, entries: dict, meta: dict) -> None:
  """Adds ``entries`` to the profiled database at ``path``, re-read just before writing so entries another process
  added meanwhile are kept."""
  data = read_json(path, {"meta": {}, "entries": {}})
  data["entries"].update(entries)
  data["meta"] = meta
  write_json(path, data, indent=0, sort_keys=True)
