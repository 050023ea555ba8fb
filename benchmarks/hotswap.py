"""Hot-swap resilience benchmark: overheads with their noise floor, recovery, survival, goodput from other runs.

  python -m benchmarks.hotswap [--failures 5] [--steps 60] [--probe-block 5] [--persist-every 10]
                               [--persist-steps 120] [--calib-per-kind 2] [--quick] [--json FILE]

Five jobs of one config (experiments/configs/hotswap.py: 4 nodes + warm spares on localhost, FSDP over the
nodes, ~13.1 MB of fp32 params; --quick: the tiny model), the persistent tier on (async orbax every
--persist-every steps) unless said otherwise:
  A. failure-free, snapshot probe: blocks of --probe-block steps alternate the layer on / off *in the same
     processes*; ratio of median step times, bootstrap 95% CI, per-side IQR (the noise);
  P. failure-free, persistence probe: a save every 2N steps only, so N-step windows after a save alternate
     with windows without one; overhead = median(window with a save) / median(window without), its bootstrap
     CI, and the noise floor: the same ratio between the two halves of the save-free windows (A/A);
  C. calibration: every failure kind --calib-per-kind times (its own schedule and seed): recovery time and
     steps recomputed per kind;
  R. the controller SIGKILLed once a persistent checkpoint is final, then a rerun in the same workdir: what was
     left behind (processes, /dev/shm), where it resumed, its restart cost (launch -> first step);
  B. --failures random failures (worker / node / replication / hang / recovery = a second node dies while
     recovering), spares respawned after each swap.
Every job's losses and every rank's final state bytes are compared with A's (trajectory_identical).
Goodput of B is *predicted from A, P and C only* (goodput.predict_schedule) and compared with B's measured
goodput. The costs of the three strategies of goodput.predict (disk checkpoint/restart, in-memory + restart,
hot swap) are all measured here, each with its source (``measured_costs``), and ``goodput_vs_mtbf`` evaluates
them over a grid of node MTBFs. Prints one JSON object and writes it, with the command, machine and date, to
benchmarks/data/hotswap_full.json (--quick: hotswap_quick.json; ``--json``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time

from benchmarks import provenance

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ["worker", "node", "replication", "hang", "recovery"]
PARTS = ["detect", "rebuild", "restore", "recompile", "first_step"]


def _median(x):
  return statistics.median(x) if x else float("nan")


def _iqr_rel(x):
  if len(x) < 4:
    return float("nan")
  q = statistics.quantiles(x, n=4)
  return (q[2] - q[0]) / q[1]


def _ratio_ci(on, off, n=2000, seed=0):
  """Bootstrap 95% interval of median(on) / median(off)."""
  if len(on) < 3 or len(off) < 3:
    return None
  rng = random.Random(seed)
  rs = sorted(statistics.median(rng.choices(on, k=len(on))) / statistics.median(rng.choices(off, k=len(off)))
              for _ in range(n))
  return [rs[int(0.025 * n)], rs[int(0.975 * n)]]


def _windows(step_log, n):
  """P's windows: sums of step times over steps (2kN, 2kN+N] (after the save at 2kN, k >= 1) and
  (2kN+N, 2kN+2N] (no save), generation 0 only, never the compiling first step."""
  dt = {x["step"]: x["dt"] for x in step_log if x["gen"] == 0 and not x["first"]}
  save, free = [], []
  k = 0
  while (2 * k + 2) * n <= max(dt, default=0):
    w_free = [dt.get(s) for s in range(2 * k * n + n + 1, 2 * k * n + 2 * n + 1)]
    if None not in w_free:
      free.append(sum(w_free))
    if k >= 1:
      w_save = [dt.get(s) for s in range(2 * k * n + 1, 2 * k * n + n + 1)]
      if None not in w_save:
        save.append(sum(w_save))
    k += 1
  return save, free


def _identical(wa, wb, nodes=4) -> bool:
  """Every loss of every step in wb equals the failure-free run's (wa), every step is there, final bytes equal."""
  from benchmarks.reliability import harness  # noqa: PLC0415
  a, b = harness.losses_by_step(wa), harness.losses_by_step(wb)
  if set(a) != set(b) or any(x != a[s][0] for s, v in b.items() for x in v):
    return False
  for r in range(nodes):
    with open(os.path.join(wa, "final", f"rank{r}.bin"), "rb") as fa, \
         open(os.path.join(wb, "final", f"rank{r}.bin"), "rb") as fb:
      if fa.read() != fb.read():
        return False
  return True


def _schedule(kinds, per_kind, steps, seed):
  rng = random.Random(seed)
  ks = [k for k in kinds for _ in range(per_kind)]
  rng.shuffle(ks)
  gap = max((steps - 4) // len(ks), 2)
  at = [min(2 + i * gap + rng.randrange(gap), steps - 1) for i in range(len(ks))]
  return {"fail_at": ",".join(map(str, at)), "fail_kind": ",".join(ks), "fail_rank": -1, "fail_seed": seed}


def _kill_and_rerun(spec, common, wr, min_step):
  """R: launcher SIGKILLed after a persistent checkpoint >= min_step; returns what it left and the rerun's summary."""
  from framework import checkpoint as ckpt_lib  # noqa: PLC0415
  from benchmarks.reliability import harness  # noqa: PLC0415
  argv = ["--config", spec, "--workdir", wr, *common]
  proc = harness.start(argv, module="resilience.launch")
  committed = None
  while proc.poll() is None:
    committed = ckpt_lib.latest_usable_step(ckpt_lib.checkpoint_dir(wr))
    if committed is not None and committed >= min_step:
      break
    time.sleep(0.05)
  if proc.poll() is not None:
    harness.finish(proc, 10, wr)
    return {"error": "the job finished before its controller could be killed"}
  rid = harness.run_ids_of(wr)[-1]
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  t_kill = time.time()
  left = harness.wait_gone(proc.pid, 60.0)
  gone_s = time.time() - t_kill
  shm = harness.shm_of(wr, rid)
  harness.finish(proc, 10, wr)
  r = harness.finish(harness.start(argv, module="resilience.launch"), 3000, wr)
  with open(os.path.join(wr, "hotswap_summary.json")) as f:
    rerun = json.load(f)
  return {"committed_at_kill": committed, "processes_left": left, "shm_left": shm, "all_gone_after_s": gone_s,
          "rerun_rc": r.rc, "rerun": rerun}


def run(args) -> dict:
  from framework import config_file  # noqa: PLC0415
  from resilience import goodput, injection  # noqa: PLC0415
  from resilience.launch import run_hotswap  # noqa: PLC0415

  root = args.workdir or tempfile.mkdtemp(prefix="prismllm_hotswap_")
  cache = os.path.join(root, "jax_cache")
  spec = "experiments/configs/hotswap.py" + (":runlocal=True" if args.quick else "")
  res = lambda **kw: [f"--config.extras.resilience.{k}={v}" for k, v in kw.items()]  # noqa: E731
  common = [f"--config.train.steps={args.steps}", *res(compile_cache_dir=cache, replicas=args.replicas,
                                                        heartbeat_timeout_s=args.heartbeat_timeout,
                                                        wall_timeout_s=3000, persist_every=args.persist_every)]
  work = {k: os.path.join(root, k) for k in ("A_failure_free", "P_persist_probe", "C_calibration",
                                              "R_controller_kill", "B_failures")}
  for w in work.values():
    shutil.rmtree(w, ignore_errors=True)
  load = lambda extra: config_file.load(spec, common + extra)  # noqa: E731
  a = run_hotswap(load(res(overhead_probe_block=args.probe_block)), work["A_failure_free"])
  p = run_hotswap(config_file.load(spec, [f"--config.train.steps={args.persist_steps}"] + common[1:] +
                                   res(persist_probe=True)), work["P_persist_probe"])
  spares = res(respawn_spares=True, spares=2)
  calib = _schedule(KINDS, args.calib_per_kind, args.steps, args.seed + 1000)
  c = run_hotswap(load(res(**calib) + spares), work["C_calibration"])
  r = _kill_and_rerun(spec, common, work["R_controller_kill"], args.persist_every)
  camp = injection.random_campaign(args.failures, args.steps, 4, args.replicas, seed=args.seed, kinds=KINDS)
  b = run_hotswap(load(res(**camp) + spares), work["B_failures"])

  # A: snapshot layer overhead; P: persistence overhead and its noise floor
  on, off = a["step_times_on_s"], a["step_times_off_s"]
  ratio, plain_step = _median(on) / _median(off), _median(off)
  n = args.persist_every
  w_save, w_free = _windows(p["step_log"], n)
  persist_ratio = _median(w_save) / _median(w_free) if w_save and w_free else float("nan")
  half_a, half_b = w_free[0::2], w_free[1::2]
  extra_per_save = _median(w_save) - _median(w_free) if w_save and w_free else float("nan")
  p_steps = [x["dt"] for x in p["step_log"] if x["gen"] == 0 and not x["first"] and not x["after_save"]]
  step_mean_free = statistics.fmean(p_steps) if p_steps else float("nan")

  # C: costs per kind; B: measured; prediction of B from A, P, C only
  def by_kind(summary):
    out = {}
    for rec in summary["recoveries"]:
      out.setdefault((rec.get("injected") or ["uninjected"])[0], []).append(rec)
    return out
  calib_by_kind = by_kind(c)
  rec_s = {k: _median([x["recovery_time_s"] for x in v]) for k, v in calib_by_kind.items()}
  recomp = {k: _median([x["steps_recomputed"] for x in v]) for k, v in calib_by_kind.items()}
  step_pred = step_mean_free + (extra_per_save / n if extra_per_save == extra_per_save else 0.0)
  pred = goodput.predict_schedule(step_pred, args.steps, camp["fail_kind"].split(","), rec_s, recomp, plain_step)
  measured_gp = goodput.measured_goodput(args.steps, plain_step, b["train_wall_s"])
  recs = b["recoveries"]
  rec_t = [x["recovery_time_s"] for x in recs]
  wa = work["A_failure_free"]
  ident = {"B": _identical(wa, work["B_failures"]), "C": _identical(wa, work["C_calibration"]),
           "P": _identical(wa, work["P_persist_probe"]) if args.persist_steps == args.steps else None}
  rr = r.get("rerun") or {}
  ident["R"] = _identical(wa, work["R_controller_kill"]) if rr else False
  st = rr.get("startup_s") or {}
  restart_s = st.get("first_step") or float("nan")
  detect = _median([x["breakdown_s"]["detect"] for k in ("worker", "node") for x in calib_by_kind.get(k, [])])
  mem_restore = _median([x["breakdown_s"]["restore"] for v in calib_by_kind.values() for x in v])
  src = lambda v, s: {"value": v, "source": s}  # noqa: E731
  costs = {
      "step_s": src(plain_step, "A: median plain (donated, no layer) step"),
      "hotswap_overhead_ratio": src(ratio * (persist_ratio if persist_ratio == persist_ratio else 1.0),
                                    f"A snapshot-layer ratio x P persistence ratio (save every {n} steps)"),
      "hotswap_recovery_s": src(_median([x["recovery_time_s"] for v in calib_by_kind.values() for x in v]),
                                "C: median recovery over every calibration failure"),
      "mem_overhead_ratio": src(ratio, "A snapshot-layer ratio (no disk)"),
      "mem_restart_s": src(detect + restart_s - (st.get("restore") or 0.0) + mem_restore,
                           "C median death detection + R relaunch-to-first-step - R orbax restore + C memory restore "
                           "(no scheduler requeue time)"),
      "disk_save_s": src(extra_per_save, "P: median extra time of a window holding one async orbax save"),
      "disk_restart_s": src(detect + restart_s, "C median death detection + R relaunch-to-first-step (agents, jax "
                                                "init, orbax restore, cached executable; no scheduler requeue time)"),
  }
  base = goodput.Costs(nodes=4, spares=1, node_mtbf_s=3600.0, **{k: v["value"] for k, v in costs.items()})
  grid = [60.0, 300.0, 1800.0, 3600.0, 6 * 3600.0, 86400.0, 7 * 86400.0]
  out = {
      "failure_free_overhead_ratio": ratio, "overhead_ratio_ci95": _ratio_ci(on, off),
      "overhead_noise_iqr_rel": {"on": _iqr_rel(on), "off": _iqr_rel(off)},
      "step_time_on_s": _median(on), "step_time_off_s": plain_step, "n_step_samples": [len(on), len(off)],
      "persist_every": n, "persist_overhead_ratio": persist_ratio, "persist_ratio_ci95": _ratio_ci(w_save, w_free),
      "persist_noise_floor_ratio": _median(half_a) / _median(half_b) if half_a and half_b else None,
      "persist_noise_floor_ci95": _ratio_ci(half_a, half_b), "persist_windows": [len(w_save), len(w_free)],
      "persist_extra_s_per_save": extra_per_save, "persist_save_blocking_ms_median": p.get("persist_save_ms_median"),
      "recovery_time_s": _median(rec_t) if rec_t else None, "recovery_time_s_max": max(rec_t) if rec_t else None,
      "recovery_breakdown_s": {q: _median([x["breakdown_s"][q] for x in recs]) for q in PARTS} if recs else None,
      "recovery_detail_s": {k: _median([x["detail_s"][k] for x in recs]) for k in recs[0]["detail_s"]} if recs else None,
      "steps_recomputed": max((x["steps_recomputed"] for x in recs), default=0),
      "restarts_during_recovery": sum(x["restarts_during_recovery"] for x in recs),
      "failures_injected": b["failures_injected"],
      "failures_survived": b["failures_injected"] if ident["B"] and b["committed"] == args.steps else 0,
      "recoveries": len(recs), "tiers": sorted({x["tier"] for x in recs}), "kinds": camp["fail_kind"],
      "trajectory_identical": ident,
      "calibration": {"recovery_s_by_kind": rec_s, "steps_recomputed_by_kind": recomp, "kinds": calib["fail_kind"]},
      "goodput_measured": measured_gp, "goodput_predicted_from_other_runs": pred["goodput"],
      "goodput_prediction_error_pct": 100.0 * (pred["goodput"] / measured_gp - 1.0) if measured_gp else None,
      "goodput_prediction": pred,
      "controller_kill": {k: v for k, v in r.items() if k != "rerun"} | {
          "resumed_from": rr.get("resumed_from"), "restart_to_first_step_s": restart_s, "startup_s": st},
      "measured_costs": costs, "goodput_vs_mtbf": goodput.goodput_vs_mtbf(base, grid),
      "snapshot_mb_per_node": (a["snapshot_bytes_per_rank"] or 0) / 1e6,
      "snapshot_copy_ms_median": a["snapshot_copy_ms_median"], "snapshot_crc_ms_median": a["snapshot_crc_ms_median"],
      "steps": args.steps, "nodes": 4, "spares": 1, "replicas": args.replicas, "quick": args.quick,
      "load_avg": os.getloadavg()[0], "wall_s": sum(x["wall_s"] for x in (a, p, c, b)), "workdir": root,
  }
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  ap = argparse.ArgumentParser()
  ap.add_argument("--failures", type=int, default=5)
  ap.add_argument("--steps", type=int, default=60)
  ap.add_argument("--probe-block", type=int, default=5)
  ap.add_argument("--persist-every", type=int, default=10)
  ap.add_argument("--persist-steps", type=int, default=120, help="steps of the persistence probe run P")
  ap.add_argument("--calib-per-kind", type=int, default=2)
  ap.add_argument("--replicas", type=int, default=1)
  ap.add_argument("--heartbeat-timeout", type=float, default=2.0)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--quick", action="store_true", help="tiny model (runlocal)")
  ap.add_argument("--workdir", default="")
  ap.add_argument("--json", default=None,
                  help="where the result goes (default: the committed benchmarks/data/hotswap_full.json, with "
                       "--quick hotswap_quick.json; '' for none)")
  args = ap.parse_args(argv)
  import logging  # noqa: PLC0415
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S",
                      stream=sys.stderr)
  t0 = time.time()
  out = run(args)
  out["bench_wall_s"] = time.time() - t0
  out.update(provenance.stamp("benchmarks.hotswap", argv, f"Python {platform.python_version()}"))
  print(json.dumps(out, default=str))
  path = args.json if args.json is not None else os.path.join(
      REPO, "benchmarks", "data", "hotswap_quick.json" if args.quick else "hotswap_full.json")
  if path:
    with open(path, "w") as f:
      json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
  main()
