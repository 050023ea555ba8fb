"""Train-step time under two settings of the host process, side by side (each a knob of `experiments.run`).

  PYTHONPATH=. python benchmarks/host_regime.py                        # --knob malloc: glibc default vs
                                                                       #   framework/host_memory.py (~6 min)
  PYTHONPATH=. python benchmarks/host_regime.py --knob devices         # 8 virtual CPU devices vs the mesh size
  PYTHONPATH=. python benchmarks/host_regime.py --configs seq128,batch32 --rounds 5 [--no-pin]

Knobs:
  malloc   glibc's default allocator ("before") vs malloc keeping freed blocks ("after", framework/host_memory.py),
           both with 8 virtual devices. Also counted: minor page faults per step.
  devices  8 virtual CPU devices ("before", experiments.run's default until session 7) vs exactly the config's
           mesh size ("after", its default now), both with host_memory applied.

Each measurement is a fresh process (both knobs are per-process settings), timing the validation suite's compiled
training step (perfmodel/validate.py's harness: warm-up, then two rounds of 7 steps). Pinned to one core with
single-threaded XLA and the CPU-time clock by default; --no-pin times the unpinned default job on wall clock.
Within a round the two settings run back to back in alternating order, so a drifting host hits both alike; the
figure per config is the median over rounds of the paired ratio after / before, with its range.

Prints one JSON object and appends a row to benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import json, math, os, resource, sys
name, n_devices, pin = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "pin"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
from framework import host_memory
host_memory.apply()  # PRISM_HOST_MALLOC=default in the environment turns it off
from perfmodel import bench
if pin:
  bench.pin()
from framework.config import from_dict, validate as validate_cfg
from perfmodel import suite, validate
entry = {e["name"]: e for e in suite.SUITE}[name]
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
import jax
print(json.dumps({"step_s": m["measured_s"], "faults_per_step": faults, "host_malloc": host_memory.state(),
                  "temp_bytes": cap.memory["temp_size_in_bytes"], "devices": len(jax.devices()),
                  "mesh_devices": math.prod(cfg.mesh.sizes().values())}))
"""
SETTINGS = {  # knob -> (before, after): (PRISM_HOST_MALLOC or None, device count or "mesh")
    "malloc": (("default", 8), ((None, 8))),
    "devices": (((None, 8)), ((None, "mesh"))),
}


def _measure(config: str, setting: tuple, pin: bool) -> dict:
  malloc, devices = setting
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("PRISM_HOST_MALLOC", None)
  if malloc:
    env["PRISM_HOST_MALLOC"] = malloc
  if devices == "mesh":
    from framework.config import from_dict  # noqa: PLC0415
    from perfmodel import suite, validate  # noqa: PLC0415
    entry = {e["name"]: e for e in suite.SUITE}[config]
    sizes = from_dict(validate._merge(suite.BASE, entry)).mesh.sizes()  # noqa: SLF001
    devices = math.prod(sizes.values())
  p = subprocess.run([sys.executable, "-c", _CHILD, config, str(devices), "pin" if pin else "nopin"], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=900)
  if p.returncode != 0:
    raise RuntimeError(f"{config}/{setting} failed: {p.stderr[-2000:]}")
  out = json.loads(p.stdout.strip().splitlines()[-1])
  want = "default" if malloc == "default" else "keep_freed"
  if out["host_malloc"] != want or out["devices"] != devices:
    raise RuntimeError(f"{config}/{setting}: the child ran with {out['host_malloc']}, {out['devices']} devices")
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--knob", choices=sorted(SETTINGS), default="malloc")
  p.add_argument("--configs", default=None, help="names from perfmodel/suite.py:SUITE (default: per knob)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--no-pin", action="store_true", help="unpinned, default XLA threads, wall clock (the plain job)")
  p.add_argument("--no-append", action="store_true")
  a = p.parse_args(argv)
  configs = a.configs or ("base,deep4,seq128,batch32" if a.knob == "malloc" else "tiny_latency,base,deep8_narrow,tp2")
  before, after = SETTINGS[a.knob]
  table = {}
  for c in configs.split(","):
    runs = {"before": [], "after": []}
    for r in range(a.rounds):
      order = ("before", "after") if r % 2 == 0 else ("after", "before")
      for s in order:
        runs[s].append(_measure(c, before if s == "before" else after, not a.no_pin))
        print(f"{c} round {r} {s}: {runs[s][-1]['step_s'] * 1e3:.2f} ms, {runs[s][-1]['devices']} devices, "
              f"{runs[s][-1]['faults_per_step']:.0f} faults/step", file=sys.stderr, flush=True)
    ratios = [x["step_s"] / b["step_s"] for x, b in zip(runs["after"], runs["before"])]
    table[c] = {"temp_mib": round(runs["after"][0]["temp_bytes"] / 2 ** 20, 1),
                "devices": [runs["before"][0]["devices"], runs["after"][0]["devices"]],
                "before_ms": round(statistics.median(x["step_s"] for x in runs["before"]) * 1e3, 2),
                "after_ms": round(statistics.median(x["step_s"] for x in runs["after"]) * 1e3, 2),
                "ratio_after_over_before": round(statistics.median(ratios), 3),
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "faults_per_step_before": round(statistics.median(x["faults_per_step"] for x in runs["before"])),
                "faults_per_step_after": round(statistics.median(x["faults_per_step"] for x in runs["after"]))}
  out = {"benchmark": f"host_regime --knob {a.knob}", "rounds": a.rounds, "pinned": not a.no_pin,
         "load_avg_1m": round(os.getloadavg()[0], 2), "configs": table}
  print(json.dumps(out))
  if not a.no_append:
    cmd = " ".join(["PYTHONPATH=. python benchmarks/host_regime.py"] + list(sys.argv[1:] if argv is None else argv))
    summary = "; ".join(f"{c}: {v['before_ms']} -> {v['after_ms']} ms (x{v['ratio_after_over_before']}, range "
                        f"{v['ratio_range'][0]}-{v['ratio_range'][1]}; devices {v['devices'][0]} -> "
                        f"{v['devices'][1]}; faults/step {v['faults_per_step_before']} -> "
                        f"{v['faults_per_step_after']})" for c, v in table.items())
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
      f.write(f"| {datetime.datetime.now().isoformat(timespec='minutes')} | `{cmd}` | {platform.node()} "
              f"{os.cpu_count()} cores (shared), load {out['load_avg_1m']}, "
              f"{'pinned, CPU time' if not a.no_pin else 'unpinned, wall'} | host regime ({a.knob}), paired per "
              f"round, median of {a.rounds} rounds: {summary} |\n")


if __name__ == "__main__":
  main()
