"""Train-step time with glibc's default allocator vs framework/host_memory.py (malloc keeps freed blocks).

  PYTHONPATH=. python benchmarks/host_allocator.py                 # 4 configs x 3 rounds x 2 settings (~6 min)
  PYTHONPATH=. python benchmarks/host_allocator.py --configs seq128,batch32 --rounds 5

Each measurement is a fresh process (the allocator is a per-process setting; a process's buffer placement is
part of what varies), pinned to one core, single-threaded XLA, 8 virtual devices as `python -m experiments.run`
uses by default, timing the validation suite's compiled training step (perfmodel/validate.py's harness:
warm-up, then two rounds of 7 steps, CPU-time clock). Within a round the two settings run back to back in
alternating order, so a drifting host hits both alike; the figure per config is the median over rounds of the
paired ratio keep / default, with its range. Also counted: minor page faults per step.

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

_CHILD = """
import json, math, os, resource, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
from framework import host_memory
host_memory.apply()  # PRISM_HOST_MALLOC=default in the environment turns it off
from perfmodel import bench
bench.pin()
from framework.config import from_dict, validate as validate_cfg
from perfmodel import suite, validate
entry = {e["name"]: e for e in suite.SUITE}[sys.argv[1]]
cfg = from_dict(validate._merge(suite.BASE, entry))
cfg = validate_cfg(cfg, math.prod(cfg.mesh.sizes().values()))
cfg = cfg.__class__(**{**cfg.__dict__, "name": entry["name"]})
m, cap = validate._measure_train_entry(cfg, 7, None)
run = validate.train_runner(cap, cfg)
run()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
  run()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 5
print(json.dumps({"step_s": m["measured_s"], "faults_per_step": faults, "host_malloc": host_memory.state(),
                  "temp_bytes": cap.memory["temp_size_in_bytes"]}))
"""


def _measure(config: str, setting: str) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if setting == "default":
    env["PRISM_HOST_MALLOC"] = "default"
  else:
    env.pop("PRISM_HOST_MALLOC", None)
  p = subprocess.run([sys.executable, "-c", _CHILD, config], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=900)
  if p.returncode != 0:
    raise RuntimeError(f"{config}/{setting} failed: {p.stderr[-2000:]}")
  out = json.loads(p.stdout.strip().splitlines()[-1])
  want = "default" if setting == "default" else "keep_freed"
  if out["host_malloc"] != want:
    raise RuntimeError(f"{config}/{setting}: the child ran with {out['host_malloc']}")
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--configs", default="base,deep4,seq128,batch32", help="names from perfmodel/suite.py:SUITE")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--no-append", action="store_true")
  a = p.parse_args(argv)
  table = {}
  for c in a.configs.split(","):
    runs = {"default": [], "keep": []}
    for r in range(a.rounds):
      order = ("default", "keep") if r % 2 == 0 else ("keep", "default")
      for s in order:
        runs[s].append(_measure(c, s))
        print(f"{c} round {r} {s}: {runs[s][-1]['step_s'] * 1e3:.2f} ms, "
              f"{runs[s][-1]['faults_per_step']:.0f} faults/step", file=sys.stderr, flush=True)
    ratios = [k["step_s"] / d["step_s"] for k, d in zip(runs["keep"], runs["default"])]
    table[c] = {"temp_mib": round(runs["keep"][0]["temp_bytes"] / 2 ** 20, 1),
                "default_ms": round(statistics.median(x["step_s"] for x in runs["default"]) * 1e3, 2),
                "keep_ms": round(statistics.median(x["step_s"] for x in runs["keep"]) * 1e3, 2),
                "ratio_keep_over_default": round(statistics.median(ratios), 3),
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "faults_per_step_default": round(statistics.median(x["faults_per_step"] for x in runs["default"])),
                "faults_per_step_keep": round(statistics.median(x["faults_per_step"] for x in runs["keep"]))}
  out = {"benchmark": "host_allocator", "rounds": a.rounds, "load_avg_1m": round(os.getloadavg()[0], 2),
         "configs": table}
  print(json.dumps(out))
  if not a.no_append:
    cmd = " ".join(["PYTHONPATH=. python benchmarks/host_allocator.py"] + list(sys.argv[1:] if argv is None else argv))
    summary = "; ".join(f"{c}: {v['default_ms']} -> {v['keep_ms']} ms (x{v['ratio_keep_over_default']}, "
                        f"range {v['ratio_range'][0]}-{v['ratio_range'][1]}; temp {v['temp_mib']} MiB, faults/step "
                        f"{v['faults_per_step_default']} -> {v['faults_per_step_keep']})" for c, v in table.items())
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
      f.write(f"| {datetime.datetime.now().isoformat(timespec='minutes')} | `{cmd}` | {platform.node()} "
              f"{os.cpu_count()} cores (shared), load {out['load_avg_1m']} | host allocator, paired per round, "
              f"median of {a.rounds} rounds: {summary} |\n")


if __name__ == "__main__":
  main()
