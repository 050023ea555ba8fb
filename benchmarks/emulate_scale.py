"""Llama-3-70B at 8192 ranks (tensor=8 x pipeline=16 x fsdp=64) emulated compile-only on the h100 target, beside
`predict` for the same config (issue 4 "Scale"; one pricing for predict and emulate).

  python -m benchmarks.emulate_scale [--hardware h100] [--framework NAME] [--config.x=y ...] [--json FILE]

Runs `python -m perfmodel.emulate --config experiments/configs/llama3_70b.py --compile-only` and then
`python -m perfmodel predict` on the same config in child processes (the emulator's peak RSS is measured), and
reports the emulated iteration time per rank class, the MFU, the per-chip memory and how far `predict` is from it.
Nothing is reduced: the step is the real one (seq 8192, 16 micro-batches of one sequence, 1F1B) compiled for 8192
compile-only devices of the target (perfmodel/target.py; the program is cached, so `predict` reads the emulator's
compile), every rank class priced from its pipeline stage's program by predict's cost chain
(perfmodel/emulate/at_scale.py). ``--config.*`` overrides go to both (e.g. the Llama 3 paper's 8192-GPU layout:
``--config.data.global_batch=2048 --config.mesh.microbatches=32``). Writes benchmarks/data/emulate_l70b.json
(``--json``), with the command, machine and date.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from benchmarks import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "experiments/configs/llama3_70b.py"


def _child(cmd: list, env: dict) -> dict:
  p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
  if p.returncode:
    raise SystemExit(f"{' '.join(cmd[2:5])} failed: {p.stderr[-3000:]}")
  return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--hardware", default="h100")
  ap.add_argument("--framework", default=None)
  ap.add_argument("--out", default=None, help="the emulator's output folder (default: a temporary one)")
  ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "data", "emulate_l70b.json"),
                  help="where the result goes (default: the committed benchmarks/data/emulate_l70b.json; '' for none)")
  a, overrides = ap.parse_known_args(argv)
  bad = [x for x in overrides if not x.startswith("--config.")]
  if bad:
    ap.error(f"unrecognised arguments {bad} (config overrides look like --config.data.global_batch=2048)")
  out_dir = a.out or tempfile.mkdtemp(prefix="emu_l70b_")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  fw = ["--framework", a.framework] if a.framework else []
  cmd = [sys.executable, "-m", "perfmodel.emulate", "--config", CONFIG, "--hardware", a.hardware, "--compile-only",
         "--out", out_dir, *fw, *overrides]
  t0 = time.perf_counter()
  res = _child(cmd, env)
  wall = time.perf_counter() - t0
  rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
  pred = _child([sys.executable, "-m", "perfmodel", "predict", "--config", CONFIG, "--hardware", a.hardware, *fw,
                 *overrides], env)
  out = {
      "benchmark": "emulate_scale", **provenance.stamp("benchmarks.emulate_scale", argv, "24 GB"), "config": CONFIG,
      "overrides": overrides, "framework": a.framework, "emulated_devices": res["emulated_devices"],
      "real_devices": res["real_devices"], "mesh": res["mesh"], "hardware": a.hardware, "executed": False,
      "reduced": "nothing", "iteration_time_s": res["iteration_time_s"], "mfu": res["mfu"],
      "per_rank": [{k: r[k] for k in ("rank", "class", "class_size", "stage", "iteration_time_s", "compute_s",
                                      "comm_s", "exposed_comm_s", "wait_s", "peak_memory_bytes", "compute_source")}
                   for r in res["ranks"]],
      "peak_memory_bytes": res["peak_memory_bytes"], "program": res["program"],
      "predict": {"step_time_s": pred["step_time_s"], "mfu": pred["mfu"], "route": pred["route"],
                  "relative_difference": pred["step_time_s"] / res["iteration_time_s"] - 1},
      "wall_time_s": res["wall_time_s"], "process_wall_s": wall, "peak_rss_bytes": rss, "notes": res["notes"],
      "trace_files": res["trace_files"]}
  print(json.dumps(out, default=str))
  if a.json:
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
