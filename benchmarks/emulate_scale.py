"""Llama-3-70B at 8192 ranks (tensor=8 x pipeline=16 x fsdp=64) emulated from one CPU device (issue 4 "Scale").

  PYTHONPATH=. python benchmarks/emulate_scale.py [--hardware h100] [--no-results]

Runs `python -m perfmodel.emulate --config experiments/configs/llama3_70b.py --compile-only` in a child
process (its peak RSS is measured) and reports the emulated iteration time, per-rank peak memory and
wall time. Nothing is reduced: per-rank shapes are the real ones (seq 8192, 16 micro-batches of one
sequence, 1F1B). The step is compiled, not executed: one rank's step is ~8 x 0.55e9 params x 131072
tokens ~ 5.8e14 FLOP (full remat), about 1.6 hours per step at this CPU's best f32 matmul rate, and
its compute time would be a CPU time, not the target's. So compute nodes are priced by the target
profile's roofline on the real per-rank graph, and the output says so (`compute_source`); collectives by
`perfmodel.cost.collectives` on the target's links; which pipeline branch runs in each tick is counted on a
shrunk copy of the program (same mesh, schedule and layer count). Memory: the compiled per-rank
program at real shapes (XLA:CPU refuses an 8192-device compile, so the byte-exact N-device number is
not available at this scale; on the validation configs the per-rank program is within 0.2-10% of it,
see benchmarks/emulate_validate.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "experiments/configs/llama3_70b.py"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--hardware", default="h100")
  ap.add_argument("--no-results", action="store_true")
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  out_dir = a.out or tempfile.mkdtemp(prefix="emu_l70b_")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cmd = [sys.executable, "-m", "perfmodel.emulate", "--config", CONFIG, "--hardware", a.hardware, "--compile-only",
         "--out", out_dir]
  t0 = time.perf_counter()
  p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
  wall = time.perf_counter() - t0
  if p.returncode:
    print(p.stderr[-3000:], file=sys.stderr)
    return p.returncode
  res = json.loads(p.stdout.strip().splitlines()[-1])
  rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
  out = {
      "benchmark": "emulate_scale", "date": datetime.datetime.now().isoformat(timespec="minutes"),
      "machine": f"{platform.machine()} {os.cpu_count()} cores (shared), 24 GB", "config": CONFIG,
      "emulated_devices": res["emulated_devices"], "real_devices": res["real_devices"], "mesh": res["mesh"],
      "hardware": a.hardware, "executed": False, "reduced": "nothing (seq 8192, 16 micro-batches, 1F1B)",
      "iteration_time_s": res["iteration_time_s"],
      "per_rank": [{k: r[k] for k in ("rank", "class", "class_size", "iteration_time_s", "compute_s", "comm_s",
                                      "wait_s", "peak_memory_bytes", "collective_calls_per_step", "compute_source",
                                      "untraced_branch_executions", "compile_s")} for r in res["ranks"]],
      "peak_memory_bytes": res["peak_memory_bytes"], "branch_trace_source": res.get("branch_trace_source"),
      "wall_time_s": res["wall_time_s"], "process_wall_s": wall, "peak_rss_bytes": rss, "notes": res["notes"],
      "trace_files": res["trace_files"]}
  print(json.dumps(out, default=str))
  if not a.no_results:
    per = "; ".join(f"{r['class']} rank {r['rank']}: {r['iteration_time_s']:.2f} s (compute {r['compute_s']:.2f}, "
                    f"comm {r['comm_s']:.2f}, bubble wait {r['wait_s']:.2f}), peak {r['peak_memory_bytes']:,} B"
                    for r in out["per_rank"])
    row = (f"| {out['date']} | `PYTHONPATH=. python benchmarks/emulate_scale.py --hardware {a.hardware}` | "
           f"{out['machine']} | Llama-3-70B, 8192 ranks from 1 CPU device, compile only (compute priced by the "
           f"{a.hardware} roofline, not measured; nothing reduced): iteration {out['iteration_time_s']:.2f} s; {per}; "
           f"branches {out['branch_trace_source']}; wall {wall:.0f} s, peak RSS {rss / 1e9:.1f} GB |\n")
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
      f.write(row)
  return 0


if __name__ == "__main__":
  sys.exit(main())
