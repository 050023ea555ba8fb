"""Reliability of the resilience / checkpoint / config area: every registered bad input and fault, classified.

  PYTHONPATH=. python benchmarks/reliability_resilience.py [--class config ...] [--fast] [--workdir DIR]
                                                            [--no-append]

Runs the cases of ``resilience/faults_cases.py``, ``faults_hotswap_cases.py`` and ``faults_lifecycle_cases.py``
(``resilience.fault_suite``) against the real entry point, one subprocess per run, and prints one JSON object:
the counts (``bad_inputs_tried``, ``recovered``, ``clear_errors``, ``unclear_errors``, ``crashes``, ``hangs``,
``silent``, ``data_lost``; the keys the ondevice area's registry prints), per class, and every case's outcome.
``--fast`` skips the cases marked slow (the multi-minute hot-swap jobs). Appends a row to benchmarks/RESULTS.md
unless --no-append. ``benchmarks/reliability.py`` (all areas) can run this area through the same functions of
``resilience.fault_suite``: ``load_cases``, ``Workspace``, ``run_case``, ``summarise``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run(classes=None, fast=False, workdir=None, log=print) -> dict:
  from resilience import fault_suite as faults  # noqa: PLC0415
  cases = [c for c in faults.load_cases() if (not classes or c.klass in classes) and not (fast and c.slow)]
  ws = faults.Workspace(workdir or tempfile.mkdtemp(prefix="prismllm_reliability_"))
  results = {}
  for c in cases:
    o = faults.run_case(c, ws)
    results[c.name] = {"class": c.klass, **o.as_dict()}
    log(f"{c.klass:20s} {c.name:42s} {o.kind:13s}{' DATA LOST' if o.data_lost else ''} {o.seconds:6.1f}s  "
        f"{o.detail[:150]}")
  per_class = {k: faults.summarise({n: r for n, r in results.items() if r["class"] == k})
               for k in sorted({r["class"] for r in results.values()})}
  return {"area": faults.AREA, **faults.summarise(results), "per_class": per_class, "cases": results,
          "workspace": ws.root, "load_avg": os.getloadavg()[0]}


def append_results(out: dict, argv) -> None:
  path = os.path.join(ROOT, "benchmarks", "RESULTS.md")
  keys = ["bad_inputs_tried", "recovered", "clear_errors", "unclear_errors", "crashes", "hangs", "silent",
          "data_lost"]
  nums = {k: out[k] for k in keys}
  nums["not_ok"] = {n: r["kind"] for n, r in out["cases"].items()
                    if r["kind"] not in ("recovered", "clear_error") or r["data_lost"]}
  nums["wall_s"] = round(out["wall_s"], 1)
  nums["load_avg"] = round(out["load_avg"], 1)
  machine = f"{platform.machine()} {os.cpu_count()} cores (shared), {platform.python_version()}"
  with open(path, "a") as f:
    f.write(f"| {datetime.datetime.now().isoformat(timespec='minutes')} | `PYTHONPATH=. python "
            f"benchmarks/reliability_resilience.py {' '.join(argv)}` | {machine} | {json.dumps(nums)} |\n")


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  ap = argparse.ArgumentParser()
  ap.add_argument("--class", dest="classes", action="append", help="only these case classes (repeatable)")
  ap.add_argument("--fast", action="store_true", help="skip the slow (multi-minute hot-swap) cases")
  ap.add_argument("--workdir", default="")
  ap.add_argument("--no-append", action="store_true")
  args = ap.parse_args(argv)
  t0 = time.time()
  out = run(args.classes, args.fast, args.workdir or None, log=lambda s: print(s, file=sys.stderr, flush=True))
  out["wall_s"] = time.time() - t0
  print(json.dumps(out, default=str))
  if not args.no_append:
    append_results(out, argv)


if __name__ == "__main__":
  main()
