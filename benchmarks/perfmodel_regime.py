"""Noise of the perfmodel measurement regimes, side by side on this (shared) host.

Runs the same workloads in child processes under each regime, interleaved round-robin so every regime sees
the same background load, and reports per regime and clock: the within-round spread (half p10-p90 range
as % of median) and the between-round drift (half the max-min range of the round medians, % of their median).

Regimes: ``plain`` (no pinning, default XLA threading, wall clock) and ``pinned`` (one core, single-threaded
XLA kernels; wall clock and process CPU time).
Workloads: a 512^3 f32 matmul, the ``base`` validation config's train step (1 device) and ``dp2_tp2``
(4 virtual devices).

  PYTHONPATH=. python benchmarks/perfmodel_regime.py [--rounds 4] [--reps 9] [--no-append]
Prints one JSON object and appends a row to benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = ("matmul512", "base", "dp2_tp2")


def child(regime: str, workload: str, reps: int) -> dict:
  from perfmodel import bench, capture
  if regime == "pinned":
    bench.pin()
  capture.ensure_devices(4)
  import jax
  import jax.numpy as jnp
  if workload == "matmul512":
    a = jnp.ones((512, 512), jnp.float32)
    r = bench.time_fn(jax.jit(lambda x: x @ x), a, reps=reps, warmup=2)
  else:
    from framework.config import from_dict, validate as validate_cfg
    from perfmodel import suite, validate
    entry = next(e for e in suite.SUITE if e["name"] == workload)
    cfg = from_dict(validate._merge(suite.BASE, entry))
    cfg = validate_cfg(cfg, cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor)
    cap = capture.train_step(cfg, keep_compiled=True)
    r = validate.measure_train(cap, cfg, reps)
  return {"wall": bench.view(r, "wall"), "cpu": bench.view(r, "cpu")}


def _spread(s):
  return 50.0 * (s["p90"] - s["p10"]) / s["median"]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=4)
  ap.add_argument("--reps", type=int, default=9)
  ap.add_argument("--no-append", action="store_true")
  ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.child:
    print(json.dumps(child(a.child[0], a.child[1], int(a.child[2]))))
    return
  res = {}
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  for _ in range(a.rounds):
    for w in WORKLOADS:
      for reg in ("plain", "pinned"):
        r = subprocess.run([sys.executable, __file__, "--child", reg, w, str(a.reps)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        if r.returncode:
          raise SystemExit(r.stderr[-3000:])
        out = json.loads(r.stdout.strip().splitlines()[-1])
        for clock in ("wall", "cpu"):
          res.setdefault((reg, clock, w), []).append(out[clock])
  table = {}
  for (reg, clock, w), rounds in res.items():
    meds = [s["median"] for s in rounds]
    mins = [s["min"] for s in rounds]
    m = statistics.median(meds)
    table[f"{reg}/{clock}/{w}"] = {"median_ms": round(1e3 * m, 3), "min_ms": round(1e3 * min(mins), 3),
                                   "within_pct": round(statistics.median(_spread(s) for s in rounds), 2),
                                   "between_pct": round(50.0 * (max(meds) - min(meds)) / m, 2),
                                   "between_min_pct": round(50.0 * (max(mins) - min(mins)) / min(mins), 2)}
  summary = {}
  for reg, clock in (("plain", "wall"), ("plain", "cpu"), ("pinned", "wall"), ("pinned", "cpu")):
    rows = [v for k, v in table.items() if k.startswith(f"{reg}/{clock}/")]
    summary[f"{reg}/{clock}"] = {"within_pct": round(statistics.median(r["within_pct"] for r in rows), 2),
                                 "between_pct": round(statistics.median(r["between_pct"] for r in rows), 2),
                                 "between_min_pct": round(statistics.median(r["between_min_pct"] for r in rows), 2)}
  out = {"rounds": a.rounds, "reps": a.reps, "load_avg": round(os.getloadavg()[0], 2), "summary": summary,
         "per_workload": table}
  print(json.dumps(out))
  if not a.no_append:
    path = os.path.join(ROOT, "benchmarks", "RESULTS.md")
    if not os.path.exists(path):
      with open(path, "w") as f:
        f.write("# Benchmark results\n\n| date | command | machine | numbers |\n|---|---|---|---|\n")
    with open(path, "a") as f:
      f.write(f"| {datetime.datetime.now().isoformat(timespec='minutes')} | python benchmarks/perfmodel_regime.py "
              f"--rounds {a.rounds} --reps {a.reps} | {platform.node()} {os.cpu_count()} cores (shared, load "
              f"{out['load_avg']}) | {json.dumps({'summary': summary})} |\n")


if __name__ == "__main__":
  main()
