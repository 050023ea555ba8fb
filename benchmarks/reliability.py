"""Bad inputs, per area: does the system recover or fail loudly? (`PYTHONPATH=. python benchmarks/reliability.py`)

Areas are registered in ``AREAS`` (name -> module). An area module provides ``load_cases()`` (a list of
cases with ``name``, ``klass``, ``timeout_s``), ``Workspace(root)`` (the good files its cases corrupt),
``run_case(case, workspace)`` -> an outcome with ``kind`` in recovered | clear_error | unclear_error | crash |
hang | silent and ``data_lost``, and ``summarise``. ondevice/fault_suite.py is the ondevice area's (GGUF files,
generation limits and the trained context, plans, ring peers, export), resilience/fault_suite.py the resilience
area's (config, checkpoints, hot swap, and a run's life cycle: stop signals, workdir lock, checks before write,
full disk); other areas add their module here.

Every case runs in its own subprocess (``--run-one``) under a time limit, so a hang is caught and killed,
and a crash cannot take the others down. Prints one JSON object (counts per area and in total, and every
case's outcome) and appends a row to benchmarks/RESULTS.md unless --no-append.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AREAS = {"ondevice": "ondevice.fault_suite", "resilience": "resilience.fault_suite"}
COUNTS = ("bad_inputs_tried", "recovered", "clear_errors", "unclear_errors", "crashes", "hangs", "silent",
          "data_lost")


def _one(spec: str, workdir: str) -> int:
  area, name = spec.split(":", 1)
  mod = importlib.import_module(AREAS[area])
  case = next(c for c in mod.load_cases() if c.name == name)
  o = mod.run_case(case, mod.Workspace(os.path.join(workdir, area)))
  print("OUTCOME " + json.dumps(o.as_dict()))
  return 0


def run(areas: list, workdir: str, only: str = "") -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OPENBLAS_NUM_THREADS="1")
  out = {"areas": {}}
  for area in areas:
    mod = importlib.import_module(AREAS[area])
    mod.Workspace(os.path.join(workdir, area))  # good files once, shared by the cases
    results = {}
    for c in mod.load_cases():
      if only and only not in (c.name, c.klass):
        continue
      t0 = time.perf_counter()
      try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--run-one", f"{area}:{c.name}",
                            "--workdir", workdir], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=c.timeout_s + 60)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("OUTCOME ")]
        r = json.loads(line[-1][8:]) if line else {"kind": "crash", "detail": (p.stderr.strip().splitlines()
                                                                              or ["no outcome"])[-1][:300],
                                                    "data_lost": False}
      except subprocess.TimeoutExpired:
        r = {"kind": "hang", "detail": f"no result within {c.timeout_s + 60:.0f} s", "data_lost": False}
      r.update(klass=c.klass, seconds=round(time.perf_counter() - t0, 2))
      results[c.name] = r
      print(f"{area:9s} {c.klass:17s} {c.name:36s} {r['kind']:13s} {r['detail'][:110]}", file=sys.stderr)
    out["areas"][area] = dict(mod.summarise(results), cases=results)
  out["total"] = {k: sum(a[k] for a in out["areas"].values()) for k in COUNTS}
  return out


def append_results(cmd: str, res: dict) -> None:
  path = os.path.join(ROOT, "benchmarks", "RESULTS.md")
  per = "; ".join(f"{a}: " + ", ".join(f"{k} {v[k]}" for k in COUNTS) for a, v in res["areas"].items())
  by_class = {}
  for a, v in res["areas"].items():
    for name, r in v["cases"].items():
      by_class.setdefault(f"{a}/{r['klass']}", []).append(r["kind"])
  classes = "; ".join(f"{k} {len(v)} ({', '.join(sorted(set(v)))})" for k, v in sorted(by_class.items()))
  not_ok = [f"{n} -> {r['kind']}" for v in res["areas"].values() for n, r in v["cases"].items()
            if r["kind"] not in ("recovered", "clear_error")]
  machine = f"{platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
  with open(path, "a") as f:
    f.write(f"| {datetime.datetime.now().isoformat(timespec='minutes')} | `{cmd}` | {machine} | {per}. By class: "
            f"{classes}. Not recovered or clear: {not_ok or 'none'} |\n")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--area", action="append", choices=sorted(AREAS), help="default: all areas")
  ap.add_argument("--only", default="", help="one case name or case class")
  ap.add_argument("--workdir", default=None, help="where the good and corrupted files go (default: a temp dir)")
  ap.add_argument("--no-append", action="store_true")
  ap.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.run_one:
    return _one(args.run_one, args.workdir)
  workdir = args.workdir or tempfile.mkdtemp(prefix="reliability-")
  res = run(args.area or sorted(AREAS), workdir, args.only)
  print(json.dumps(res))
  if not args.no_append and not args.only:
    append_results("PYTHONPATH=. python benchmarks/reliability.py " + " ".join(argv if argv is not None else
                                                                              sys.argv[1:]), res)
  return 0


if __name__ == "__main__":
  sys.exit(main())
