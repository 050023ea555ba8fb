"""Hot-swap resilience benchmark: overhead, recovery time, recomputed steps, bit-identical trajectory.

  python benchmarks/hotswap.py [--failures 5] [--steps 60] [--probe-block 5] [--quick] [--no-append]

Two jobs with the same config (experiments/configs/hotswap.py: 4 nodes + 1 warm spare on localhost,
FSDP over the nodes, ~13.1 MB of fp32 params):
  A. failure-free, with the overhead probe: blocks of --probe-block steps alternate the layer on
     (non-donated step + snapshot + replication + commit) and off (the plain donated step) *in the same
     processes*, so the ratio of median step times is measured side by side under the same load;
  B. the same job with --failures randomized failures (worker/node/replication/hang; 'two' when
     replicas >= 2), spares respawned after each swap (a repaired node rejoins the pool).
trajectory_identical compares every loss (float equality) and every rank's final state bytes of B with A.
Goodput: resilience.goodput predicts B's goodput from the measured costs and B's failure rate, and the
measured goodput is steps x plain step time / training wall time.
Prints one JSON object and appends a row to benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _median(x):
  return statistics.median(x) if x else float("nan")


def _iqr_rel(x):
  if len(x) < 4:
    return float("nan")
  q = statistics.quantiles(x, n=4)
  return (q[2] - q[0]) / q[1]


def _ratio_ci(on, off, n=2000, seed=0):
  """Bootstrap 95% interval of median(on) / median(off): the noise of the overhead ratio."""
  import random  # noqa: PLC0415
  if len(on) < 4 or len(off) < 4:
    return None
  rng = random.Random(seed)
  rs = sorted(statistics.median(rng.choices(on, k=len(on))) / statistics.median(rng.choices(off, k=len(off)))
              for _ in range(n))
  return [rs[int(0.025 * n)], rs[int(0.975 * n)]]


def run(args) -> dict:
  from framework import config_file  # noqa: PLC0415
  from resilience import goodput, injection  # noqa: PLC0415
  from resilience.launch import run_hotswap  # noqa: PLC0415

  root = args.workdir or tempfile.mkdtemp(prefix="prismllm_hotswap_")
  cache = os.path.join(root, "jax_cache")
  spec = "experiments/configs/hotswap.py" + (":runlocal=True" if args.quick else "")
  common = [f"--config.train.steps={args.steps}", f"--config.extras.resilience.compile_cache_dir={cache}",
            f"--config.extras.resilience.replicas={args.replicas}",
            f"--config.extras.resilience.heartbeat_timeout_s={args.heartbeat_timeout}",
            "--config.extras.resilience.wall_timeout_s=3000"]
  wa, wb = os.path.join(root, "A_failure_free"), os.path.join(root, "B_failures")
  for w in (wa, wb):
    shutil.rmtree(w, ignore_errors=True)
  cfg_a = config_file.load(spec, common + [f"--config.extras.resilience.overhead_probe_block={args.probe_block}"])
  a = run_hotswap(cfg_a, wa)
  camp = injection.random_campaign(args.failures, args.steps, 4, args.replicas, seed=args.seed)
  cfg_b = config_file.load(spec, common + [f"--config.extras.resilience.{k}={v}" for k, v in camp.items()] +
                           ["--config.extras.resilience.respawn_spares=True"])
  b = run_hotswap(cfg_b, wb)

  on, off = a["step_times_on_s"], a["step_times_off_s"]
  identical = a["losses"] == b["losses"] and a["final_crc"] == b["final_crc"] and not b["loss_mismatch_on_recompute"]
  for r in range(a["nodes"]):
    with open(os.path.join(wa, "final", f"rank{r}.bin"), "rb") as fa, open(os.path.join(wb, "final", f"rank{r}.bin"),
                                                                          "rb") as fb:
      identical = identical and fa.read() == fb.read()
  recs = b["recoveries"]
  parts = ["detect", "rebuild", "restore", "recompile", "first_step"]
  ratio = _median(on) / _median(off)
  rec_t = [r["recovery_time_s"] for r in recs]
  survived = b["failures_injected"] if identical else 0
  plain_step = _median(off)
  rate = b["failures_injected"] / b["train_wall_s"] if b["train_wall_s"] > 0 else 0.0
  pred = goodput.predict(goodput.Costs(step_s=plain_step, nodes=4, node_mtbf_s=4 / rate if rate else 1e18,
                                       spares=1, hotswap_overhead_ratio=ratio,
                                       hotswap_recovery_s=_median(rec_t) if rec_t else 0.0,
                                       mem_overhead_ratio=ratio))
  measured_gp = goodput.measured_goodput(args.steps, plain_step, b["train_wall_s"])
  predicted_gp = goodput.predict_injected(plain_step, ratio, _median(rec_t) if rec_t else 0.0,
                                          b["failures_injected"], args.steps)
  out = {
      "failure_free_overhead_ratio": ratio,
      "overhead_ratio_ci95": _ratio_ci(on, off),
      "overhead_noise_iqr_rel": {"on": _iqr_rel(on), "off": _iqr_rel(off)},
      "step_time_on_s": _median(on), "step_time_off_s": plain_step, "n_step_samples": [len(on), len(off)],
      "recovery_time_s": _median(rec_t) if rec_t else None,
      "recovery_time_s_max": max(rec_t) if rec_t else None,
      "recovery_breakdown_s": {p: _median([r["breakdown_s"][p] for r in recs]) for p in parts} if recs else None,
      "recovery_detail_s": {k: _median([r["detail_s"][k] for r in recs]) for k in recs[0]["detail_s"]} if recs else None,
      "steps_recomputed": max((r["steps_recomputed"] for r in recs), default=0),
      "steps_recomputed_total": sum(r["steps_recomputed"] for r in recs),
      "trajectory_identical": identical,
      "failures_injected": b["failures_injected"], "failures_survived": survived, "recoveries": len(recs),
      "tiers": sorted({r["tier"] for r in recs}), "kinds": camp["fail_kind"],
      "goodput_measured": measured_gp, "goodput_predicted_hotswap": predicted_gp,
      # the same measured costs under exponential failures at the observed wall-clock rate, all strategies
      # (disk/in-memory restart costs are the Costs defaults, not measured here)
      "goodput_model_exponential": pred["goodput"],
      "snapshot_mb_per_node": (a["snapshot_bytes_per_rank"] or 0) / 1e6,
      "snapshot_copy_ms_median": a["snapshot_copy_ms_median"], "snapshot_crc_ms_median": a["snapshot_crc_ms_median"],
      "snapshots_skipped": a["snapshots_skipped"],
      "steps": args.steps, "nodes": 4, "spares": 1, "replicas": args.replicas, "quick": args.quick,
      "load_avg": os.getloadavg()[0], "wall_s": a["wall_s"] + b["wall_s"], "workdir": root,
  }
  return out


def append_results(out: dict, argv) -> None:
  path = os.path.join(REPO, "benchmarks", "RESULTS.md")
  if not os.path.exists(path):
    with open(path, "w") as f:
      f.write("# Benchmark results\n\n| date | command | machine | numbers |\n|---|---|---|---|\n")
  keys = ["failure_free_overhead_ratio", "overhead_ratio_ci95", "overhead_noise_iqr_rel", "recovery_time_s", "recovery_time_s_max",
          "recovery_breakdown_s", "steps_recomputed", "trajectory_identical", "failures_injected",
          "failures_survived", "tiers", "goodput_measured", "goodput_predicted_hotswap", "snapshot_mb_per_node",
          "load_avg"]
  nums = json.dumps({k: (round(v, 4) if isinstance(v, float) else
                         ({a: round(b, 3) for a, b in v.items()} if isinstance(v, dict) else
                          ([round(x, 4) for x in v] if isinstance(v, list) and v and isinstance(v[0], float) else v)))
                     for k, v in out.items() if k in keys})
  machine = f"{platform.machine()} {os.cpu_count()} cores (shared), {platform.python_version()}"
  with open(path, "a") as f:
    f.write(f"| {datetime.datetime.now().isoformat(timespec='minutes')} | `python benchmarks/hotswap.py "
            f"{' '.join(argv)}` | {machine} | {nums} |\n")


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  ap = argparse.ArgumentParser()
  ap.add_argument("--failures", type=int, default=5)
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--probe-block", type=int, default=5)
  ap.add_argument("--replicas", type=int, default=1)
  ap.add_argument("--heartbeat-timeout", type=float, default=2.0)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--quick", action="store_true", help="tiny model (runlocal) for a smoke run")
  ap.add_argument("--workdir", default="")
  ap.add_argument("--no-append", action="store_true")
  args = ap.parse_args(argv)
  import logging  # noqa: PLC0415
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S",
                      stream=sys.stderr)
  t0 = time.time()
  out = run(args)
  out["bench_wall_s"] = time.time() - t0
  print(json.dumps(out, default=str))
  if not args.no_append:
    append_results(out, argv)


if __name__ == "__main__":
  main()
