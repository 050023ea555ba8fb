"""Emulator cost vs emulated ranks: wall time and host peak memory of `python -m perfmodel emulate` from ONE
CPU device as the emulated mesh grows 8 -> 8192 ranks (PrismLLM's scale figure).

  python -m benchmarks.emulate_ranks [--ranks 8,64,512,2048,8192] [--out FILE]
  (default FILE: benchmarks/data/emulate_ranks.json, which the figure reads)

The model is `experiments/configs/llama3_70b.py:runlocal=True` (toy widths, 4 layers, 1F1B over 2 stages), on the
mesh data=N/8 x fsdp=2 x tensor=2 x pipeline=2 with 2 sequences per data x fsdp replica (global batch N/2), so
every rank's shapes are the same at every N and only the emulated job grows. Each point runs the emulator in its
own child process (executed, 3 timed steps after 1 warm-up, target profile h100); host memory is that child's peak
RSS (wait4); its CPU time (user + system, less sensitive than wall time to the other jobs on a shared host) is
recorded beside the wall time, with the load average before and after. In the emulated iteration time, compute is
measured on this CPU (the real rank executes) and collectives are priced on the h100 profile's links, so its
communication grows with the data-parallel all-reduce group.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "experiments/configs/llama3_70b.py:runlocal=True"


def one(n: int, hardware: str, out_dir: str) -> dict:
  if n % 8:
    raise ValueError(f"ranks must be a multiple of 8 (fsdp 2 x tensor 2 x pipeline 2), got {n}")
  mesh = f"data={n // 8},fsdp=2,tensor=2,pipeline=2"
  cmd = [sys.executable, "-m", "perfmodel", "emulate", "--config", CONFIG, f"--config.data.global_batch={n // 2}",
         "--mesh", mesh, "--hardware", hardware, "--repeats", "3", "--warmup", "1", "--out", out_dir]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  load0 = os.getloadavg()[0]
  t0 = time.perf_counter()
  with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fo, stderr=fe, text=True)
    _, status, usage = os.wait4(p.pid, 0)  # this child's own rusage: its peak RSS alone
    wall = time.perf_counter() - t0
    fo.seek(0), fe.seek(0)
    stdout, stderr = fo.read(), fe.read()
  if os.waitstatus_to_exitcode(status):
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
  res = json.loads(stdout.strip().splitlines()[-1])
  return {"emulated_ranks": res["emulated_devices"], "real_devices": res["real_devices"], "mesh": res["mesh"],
          "program_classes": [c["class"] for c in res["slicing"]["classes"]],
          "process_wall_s": wall, "emulator_wall_s": res["wall_time_s"],
          "iteration_time_s": res["iteration_time_s"], "peak_memory_bytes_per_rank": res["peak_memory_bytes"],
          "per_rank": [{k: r[k] for k in ("rank", "class", "class_size", "iteration_time_s", "compute_s", "comm_s",
                                          "wait_s")} for r in res["ranks"]],
          "process_cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_bytes": usage.ru_maxrss * 1024,
          "load_avg_1m": [load0, os.getloadavg()[0]], "command": " ".join(cmd[1:])}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--ranks", default="8,64,512,2048,8192")
  ap.add_argument("--hardware", default="h100")
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "data", "emulate_ranks.json"))
  a = ap.parse_args(argv)
  points = []
  for n in [int(x) for x in a.ranks.split(",")]:
    pt = one(n, a.hardware, tempfile.mkdtemp(prefix=f"emu_ranks_{n}_"))
    points.append(pt)
    print(f"{n} ranks: wall {pt['process_wall_s']:.1f} s, CPU {pt['process_cpu_s']:.1f} s, "
          f"peak RSS {pt['peak_rss_bytes'] / 1e9:.2f} GB, "
          f"iteration {pt['iteration_time_s'] * 1e3:.2f} ms, load {pt['load_avg_1m']}", file=sys.stderr, flush=True)
  out = {"benchmark": "emulate_ranks", **provenance.stamp("benchmarks.emulate_ranks", argv), "config": CONFIG,
         "hardware": a.hardware, "points": points}
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)
  print(json.dumps({"out": a.out, "points": len(points)}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
