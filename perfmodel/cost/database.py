"""Where measured node data lives, and the ``profiled`` backend that reads it.

Two kinds of files, both keyed by profile name and jax version:

* the **node samples** of the ``learned`` and ``hybrid`` backends (``<profile>-nodes-jax<v>.json``): node times
  measured inside the calibration programs; written by ``python -m perfmodel calibrate`` only;
* the **profiled database** (``<profile>-jax<v>.json``): each node fingerprint's time, its instruction cut out of the
  program and timed alone (perfmodel/cost/profiler.py).

Both are read from ``perfmodel/profiles/db/`` (committed, written by ``calibrate --commit`` only), from the user's
calibration (``<cache>/profiles/db/``, written by ``calibrate``) and from the user's cache (``<cache>/db/``, where
profiling a program during ``predict`` or ``validate`` writes); ``<cache>`` is ``$PRISMLLM_CACHE``, else
``~/.cache/prismllm``. The node samples of a user's calibration replace the committed ones; a profiled entry of the
user's takes precedence over a committed one of the same key: it was timed later, on this host.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Optional

import jax

from perfmodel.graph.nodes import Node
from perfmodel.hardware import CACHE_ENV, HardwareProfile, cache_root, user_profile_dir  # noqa: F401 (tests set it)
from perfmodel.cost.physical import Priced

DB_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "profiles", "db")


def cache_dir() -> str:
  return os.path.join(cache_root(), "db")


def db_name(profile: str) -> str:
  return f"{profile}-jax{jax.__version__}.json"


def samples_name(profile: str) -> str:
  return f"{profile}-nodes-jax{jax.__version__}.json"


def committed_path(name: str) -> str:
  return os.path.join(DB_DIR, name)


def cache_path(name: str) -> str:
  return os.path.join(cache_dir(), name)


def calibration_db_path(name: str, profile_dir: str) -> str:
  """``name`` in the node-data folder of the calibration whose profiles are in ``profile_dir``."""
  return os.path.join(profile_dir, "db", name)


def samples_path(profile: str) -> str:
  """The node samples prediction reads: the user's calibration's when it has them, else the committed ones."""
  user = calibration_db_path(samples_name(profile), user_profile_dir())
  return user if os.path.exists(user) else committed_path(samples_name(profile))


_LOADED = {}  # (path, mtime, size) -> parsed JSON


def load_json(path: str):
  """``json.load`` of ``path``, parsed once per version of the file: a prediction builds its cost chain afresh and
  the node samples and profiled database are megabytes. Callers must not modify the result."""
  st = os.stat(path)
  key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
  if key not in _LOADED:
    if len(_LOADED) >= 8:
      _LOADED.clear()
    with open(path) as f:
      _LOADED[key] = json.load(f)
  return _LOADED[key]


def read_entries(paths: list) -> dict:
  """The profiled entries of ``paths`` merged, later files winning; missing files are skipped."""
  out = {}
  for p in paths:
    if p and os.path.exists(p):
      out.update(load_json(p).get("entries", {}))
  return out


def profiled_paths(profile: str) -> list:
  """The profiled database of ``profile`` as prediction reads it: committed, the user's calibration, the user's
  cache."""
  name = db_name(profile)
  return [committed_path(name), calibration_db_path(name, user_profile_dir()), cache_path(name)]


class Profiled:
  """Measured node times keyed by fingerprint (the instruction timed alone)."""
  name = "profiled"

  def __init__(self, hw: HardwareProfile, path: Optional[str] = None):
    self.hw = hw
    self.table = read_entries([path] if path else profiled_paths(hw.name))

  def seconds(self, fingerprint: str) -> Optional[float]:
    """The measured time of a node fingerprint; None when the database has none."""
    t = self.table.get(fingerprint)
    if t is None:
      return None
    return float(t["s"]) if isinstance(t, dict) else float(t)

  def price(self, node: Node) -> Optional[Priced]:
    s = self.seconds(node.fingerprint)
    if s is None:
      return None
    t = self.table[node.fingerprint]
    return Priced(s, f"{self.name}:{t.get('method', '')}".rstrip(":") if isinstance(t, dict) else self.name)


# ---------------------------------------------------------------- writing (one file replaced in one step)

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


def merge_entries(path: str, entries: dict, meta: dict) -> None:
  """Adds ``entries`` to the profiled database at ``path``, re-read just before writing so entries another process
  added meanwhile are kept."""
  data = read_json(path, {"meta": {}, "entries": {}})
  data["entries"].update(entries)
  data["meta"] = meta
  write_json(path, data, indent=0, sort_keys=True)
