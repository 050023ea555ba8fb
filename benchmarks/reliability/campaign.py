"""Runs the campaign: every selected case of every selected area, each in its own subprocess under its time limit
(a hang is killed, a crash cannot take the others down), and counts the outcomes per area, per class and in
total. The JSON goes to ``--out`` (default ``<workdir>/reliability.json``); only ``--commit`` writes the
committed ``benchmarks/data/reliability.json`` (rendered into benchmarks/RESULTS.md by ``python -m
benchmarks.results``).

An area is a module with ``AREA``, ``CASES`` (the registry its case modules fill: cases with ``name``, ``klass``,
``timeout_s``, ``slow``) and ``Workspace(root)`` (the good files its cases start from); ``harness.run_case`` runs a
case and ``harness.summarise`` counts.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from typing import Callable, Iterable

from benchmarks.reliability import harness, ondevice_area, resilience_area
# importing the case modules registers their cases
from benchmarks.reliability import hotswap_cases, lifecycle_cases, resilience_cases  # noqa: F401
from benchmarks.reliability import ondevice_cases, run_cases, serve_cases  # noqa: F401

AREAS = {"ondevice": ondevice_area, "resilience": resilience_area}
COMMITTED = os.path.join(harness.ROOT, "benchmarks", "data", "reliability.json")


def area(name: str):
  return AREAS[name]


def load_cases(name: str) -> list:
  """Every registered case of area ``name``."""
  return AREAS[name].CASES.cases


def select(cases: list, only: Iterable[str] = (), classes: Iterable[str] = (), fast: bool = False) -> list:
  """Cases named in ``only`` (a case name or a class), of ``classes``, without the slow ones when ``fast``."""
  only, classes = set(only or ()), set(classes or ())
  return [c for c in cases if (not only or c.name in only or c.klass in only)
          and (not classes or c.klass in classes) and not (fast and c.slow)]


def unknown(names: Iterable[str], areas: Iterable[str]) -> list:
  """Names in ``names`` that are neither a case nor a class of ``areas``."""
  known = set()
  for a in areas:
    for c in load_cases(a):
      known |= {c.name, c.klass}
  return sorted(set(names) - known)


def run_one(spec: str, workdir: str) -> int:
  """``area:case`` in this process; prints ``OUTCOME <json>`` for the campaign that started it."""
  name_area, name = spec.split(":", 1)
  mod = area(name_area)
  case = next(c for c in load_cases(name_area) if c.name == name)
  o = harness.run_case(case, mod.Workspace(os.path.join(workdir, name_area)))
  print("OUTCOME " + json.dumps(o.as_dict()), flush=True)
  return 0


def _in_subprocess(name_area: str, c, workdir: str, env: dict) -> dict:
  try:
    p = subprocess.run([sys.executable, "-m", "benchmarks.reliability", "--run-one", f"{name_area}:{c.name}",
                        "--workdir", workdir], cwd=harness.ROOT, env=env, capture_output=True, text=True,
                       timeout=c.timeout_s + 60)
  except subprocess.TimeoutExpired:
    return {"kind": "hang", "detail": f"no result within {c.timeout_s + 60:.0f} s", "data_lost": False}
  line = [ln for ln in p.stdout.splitlines() if ln.startswith("OUTCOME ")]
  if line:
    return json.loads(line[-1][len("OUTCOME "):])
  return {"kind": "crash", "detail": (p.stderr.strip().splitlines() or ["no outcome"])[-1][:300], "data_lost": False}


def run(areas: list, workdir: str, only=(), classes=(), fast: bool = False, log: Callable = print) -> dict:
  env = dict(os.environ, PYTHONPATH=harness.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             OPENBLAS_NUM_THREADS="1")
  t0 = time.time()
  out = {"areas": {}}
  for name_area in areas:
    mod = area(name_area)
    cases = select(load_cases(name_area), only, classes, fast)
    if cases:
      mod.Workspace(os.path.join(workdir, name_area))  # the good files once, shared by the cases
    results = {}
    for c in cases:
      t = time.perf_counter()
      r = _in_subprocess(name_area, c, workdir, env)
      r.update(klass=c.klass, seconds=round(time.perf_counter() - t, 2))
      results[c.name] = r
      log(f"{name_area:10s} {c.klass:18s} {c.name:40s} {r['kind']:13s}{' DATA LOST' if r['data_lost'] else ''} "
          f"{r['seconds']:6.1f}s  {r['detail'][:110]}")
    per_class = {k: {n: v for n, v in harness.summarise({n: r for n, r in results.items() if r["klass"] == k}).items()
                     if n in harness.COUNTS}
                 for k in sorted({r["klass"] for r in results.values()})}
    out["areas"][name_area] = dict(harness.summarise(results), per_class=per_class, cases=results)
  out["total"] = {k: sum(a[k] for a in out["areas"].values()) for k in harness.COUNTS}
  out["total"]["not_exercised_cases"] = [f"{a}/{n}" for a, v in out["areas"].items() for n in v["not_exercised_cases"]]
  out.update(workdir=workdir, wall_s=round(time.time() - t0, 1), load_avg=round(os.getloadavg()[0], 1),
             machine=f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}")
  return out


def write(res: dict, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(res, f)
  os.replace(path + ".tmp", path)
  return path


