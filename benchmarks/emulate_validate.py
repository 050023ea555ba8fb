"""Emulation vs real runs on localhost (issue 4 validation): iteration time and peak memory, side by side
with `perfmodel predict` (calibrated backend) and the roofline, for the data / tensor / pipeline layouts of
experiments/configs/emulate_validate.py.

  python -m benchmarks.emulate_validate [--rounds 3] [--layouts data,tensor,pipeline] [--json FILE]

Per round and layout, interleaved (real, emulated, real again; layouts rotated between rounds). The host's
speed drifts by up to ~35% within an hour and 5-15% between consecutive minutes (README), so the emulation is
compared with the mean of the real runs just before and just after it (`--no-bracket`: the one before only);
a linear drift then cancels instead of landing on the error:
  * real: `experiments.run` as 2 processes (jax.distributed, gloo over loopback), process i pinned to core
    i, single-threaded XLA; time = median of metrics.jsonl `step_time_s` after the warm-up steps. Each
    process also reports `memory_analysis()` of the step it compiled (the real per-rank program).
  * emulated: `perfmodel.emulate --colocated 2` in 1 process pinned to core 0 (where real rank 0 ran): one
    real rank, the other a virtual peer whose load on the shared memory system is replayed by a shadow
    process on core 1 (perfmodel/emulate/shadow.py); side by side, the same emulation with the rank timed
    alone (`--colocated 1`, column "alone"); collectives priced by the 2-process gloo calibration
    (perfmodel/emulate/gloo_calibration.py, re-measured right before each emulation for the kinds its
    layout issues, so it sees the host's current load; `--gloo-when round`: once per round); with `--replay`, each of the program's own 2-rank calls is replayed between 2 gloo
    processes instead (`emulate --replay-collectives`; the curve-priced result is kept beside it); memory
    from the real 2-device program compiled on 2 virtual devices.
  * predict / roofline: `python -m perfmodel predict` (compile method) once per layout.
Prints one JSON object and writes benchmarks/data/emulate_validate.json (``--json``; with the command, machine and
date) and benchmarks/emulate_validate.png.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

from benchmarks import provenance
from experiments import run
from framework import host_memory
from parallelism.distributed import free_port
from perfmodel.emulate import gloo_calibration, localrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "experiments/configs/emulate_validate.py"


# ------------------------------------------------------------------ real-run child
def child_real(spec: str, workdir: str, coord: str, pid: int, steps: int) -> None:
  """One process of the real job: experiments.run's own code path, plus the compiled step's memory."""
  host_memory.apply()  # what run.main does first; here before jax is imported (framework/host_memory.py)
  import jax  # noqa: PLC0415 (after host_memory.apply(): allocator settings apply to threads created later)
  from parallelism import step as step_lib  # noqa: PLC0415 (loads jax: after host_memory.apply())
  captured = {}
  orig_build = step_lib.build_step

  def build(cfg_, mesh):
    captured["step"] = orig_build(cfg_, mesh)
    return captured["step"]
  step_lib.build_step = build
  patched = False  # the framework now gives each process the rows its devices hold (CompiledStep.local_rows)
  # Per-step wall and process-CPU clocks of the real loop: the loop syncs on the loss every step
  # (log_every=1), so consecutive step calls delimit steps.
  clocks = []
  orig_call = step_lib.CompiledStep.__call__

  ready = []

  def call(self, state, batch):
    clocks.append((time.perf_counter(), time.process_time()))
    out = orig_call(self, state, batch)
    jax.block_until_ready(out)  # the loop reads the loss right after anyway (log_every=1)
    ready.append(time.perf_counter() - clocks[-1][0])  # the step call itself: put + compute + collectives
    return out
  step_lib.CompiledStep.__call__ = call
  rc = run.main(["--config", spec, "--workdir", workdir, "--coordinator", coord, "--num-processes", "2",
                 "--process-id", str(pid), f"--config.train.steps={steps}"])
  st = captured["step"]
  compiled = st.lower().compile()
  m = compiled.memory_analysis()
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
  mem = {k: int(getattr(m, k)) for k in keys}
  mem["peak_bytes"] = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] - mem["alias_size_in_bytes"]
                       + mem["temp_size_in_bytes"])
  steps_wall = [b[0] - a[0] for a, b in zip(clocks, clocks[1:])]
  steps_cpu = [b[1] - a[1] for a, b in zip(clocks, clocks[1:])]
  print("@@" + json.dumps({"rc": rc, "pid": pid, "memory": mem, "put_batch_workaround": patched,
                           "step_wall_s": steps_wall, "step_cpu_s": steps_cpu, "call_s": ready}))


# ------------------------------------------------------------------ parent
def _stats(xs):
  xs = sorted(xs)
  if not xs:
    return {"median": None, "p10": None, "p90": None, "n": 0}
  return {"median": statistics.median(xs), "p10": xs[int(0.1 * (len(xs) - 1))],
          "p90": xs[int(round(0.9 * (len(xs) - 1)))], "n": len(xs)}


def run_real(layout: str, steps: int, warmup_steps: int) -> dict:
  spec = f"{CONFIG}:layout={layout}"
  wd = tempfile.mkdtemp(prefix=f"ev_real_{layout}_")
  coord = f"127.0.0.1:{free_port()}"
  cmds = [localrun.python(os.path.abspath(__file__), "--child-real", spec, wd, coord, str(i), str(steps))
          for i in range(2)]
  load0 = os.getloadavg()[0]
  done = localrun.run_pinned(cmds, localrun.cores()[:2], timeout_s=900)
  if done.rc != [0, 0]:
    raise RuntimeError(f"real run {layout} failed rc={done.rc}: {done.stderr[0][-3000:]} {done.stderr[1][-1500:]}")
  info = [json.loads([l for l in o.splitlines() if l.startswith("@@")][-1][2:]) for o in done.stdout]
  recs = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl")) if l.strip()]
  times = [r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] > warmup_steps]
  cpu = [info[i].get("step_cpu_s", [])[warmup_steps:] for i in range(2)]
  calls = [info[i].get("call_s", [])[warmup_steps:] for i in range(2)]
  return {"step_times_s": times, **_stats(times), "memory_per_rank": [i["memory"] for i in info],
          "call_median_per_rank": [_stats(c)["median"] for c in calls],
          "step_cpu_s_per_rank": cpu, "cpu_median_per_rank": [_stats(c)["median"] for c in cpu],
          "put_batch_workaround": info[0]["put_batch_workaround"], "wall_s": done.wall_s,
          "load_avg_1m": [load0, os.getloadavg()[0]]}


def run_emulated(layout: str, repeats: int, warmup: int, exact_memory: bool, colocated: int = 2,
                 replay: bool = False, trace_nodes: bool = False, lockstep: bool = False) -> dict:
  out = tempfile.mkdtemp(prefix=f"ev_emu_{layout}_")
  cmd = localrun.python("-m", "perfmodel.emulate", "--config", f"{CONFIG}:layout={layout}", "--hardware", "cpu",
                        "--repeats", str(repeats), "--warmup", str(warmup), "--out", out,
                        "--colocated", str(colocated))
  if exact_memory:
    cmd.append("--exact-memory")
  if replay:
    cmd.append("--replay-collectives")
  if trace_nodes:
    cmd.append("--trace-nodes")
  if lockstep:
    cmd.append("--lockstep-shadows")
  load0 = os.getloadavg()[0]
  done = localrun.run_pinned([cmd], localrun.cores()[:1], timeout_s=900)
  if done.rc != [0]:
    raise RuntimeError(f"emulation {layout} failed: {done.stderr[0][-3000:]}")
  res = json.loads(done.stdout[0].strip().splitlines()[-1])
  res["load_avg_1m"] = [load0, os.getloadavg()[0]]
  res["wall_s_process"] = done.wall_s
  return res


def run_predict(layout: str, backend: str) -> dict:
  env = localrun.base_env(2)
  p = subprocess.run([sys.executable, "-m", "perfmodel", "predict", "--config", f"{CONFIG}:layout={layout}",
                      "--hardware", "cpu", "--method", "compile", "--backend", backend], env=env, cwd=ROOT,
                     capture_output=True, text=True, timeout=900)
  try:
    return json.loads(p.stdout.strip().splitlines()[-1])
  except (IndexError, json.JSONDecodeError):
    return {"error": p.stderr[-1500:]}


N_RANKS = 2  # the real job's processes (one rank each)
# the collective kinds each layout's program issues (its emulation's timeline, experiments/configs/emulate_validate.py)
LAYOUT_KINDS = {"data": ("all-reduce",), "tensor": ("all-reduce",), "pipeline": ("all-reduce", "collective-permute")}


def _pred_time(d: dict):
  for k in ("step_time_s", "iteration_time_s", "time_s"):
    if isinstance(d.get(k), (int, float)):
      return float(d[k])
  return None


def aggregate(rounds: list, layouts: list, predict: bool = True, previous: Optional[dict] = None) -> dict:
  """Per-layout comparison from the raw rounds (real and emulated runs), plus predict/roofline."""
  per = {}
  for lay in layouts:
    reals = [rd["layouts"][lay]["real"] for rd in rounds]
    emus = [rd["layouts"][lay]["emulated"] for rd in rounds]
    afters = [rd["layouts"][lay].get("real_after") for rd in rounds]
    # every real run measures the same job: the real value is the median over all of them (before and after)
    real_med = statistics.median([x["median"] for x in reals] + [x["median"] for x in afters if x])
    emu_med = statistics.median(x["iteration_time_s"] for x in emus)
    paired = [e["iteration_time_s"] / _bracket(x, y) - 1 for e, x, y in zip(emus, reals, afters)]
    before_only = [e["iteration_time_s"] / x["median"] - 1 for e, x in zip(emus, reals)]
    frees = [rd["layouts"][lay].get("emulated_free") for rd in rounds]
    free_paired = [100 * (f["iteration_time_s"] / _bracket(x, y) - 1) for f, x, y in zip(frees, reals, afters) if f]
    drift = [100 * (y["median"] / x["median"] - 1) for x, y in zip(reals, afters) if y]
    alone = [rd["layouts"][lay].get("emulated_alone") for rd in rounds]
    alone = [a_["iteration_time_s"] for a_ in alone if a_]
    alone_med = statistics.median(alone) if alone else None
    all_reals = reals + [x for x in afters if x]
    real_noise = statistics.median(100 * (x["p90"] - x["p10"]) / x["median"] for x in all_reals)
    across = 100 * (max(x["median"] for x in all_reals) - min(x["median"] for x in all_reals)) / real_med
    mem_real = reals[0]["memory_per_rank"]
    e0 = emus[0]
    exact = (e0.get("exact_memory") or {}).get("peak_bytes")
    standin = max(rk["per_rank_program_memory"]["peak_bytes"] for rk in e0["ranks"])
    if predict:
      pred, roof = run_predict(lay, "auto"), run_predict(lay, "roofline")
    else:
      old = (previous or {}).get(lay, {})
      pred, roof = {"step_time_s": old.get("predict_s")}, {"step_time_s": old.get("roofline_s")}
    per[lay] = {
        "real_s": real_med, "emulated_s": emu_med, "error_pct": 100 * (emu_med / real_med - 1),
        "emulated_interference": e0.get("interference"),
        "emulated_alone_s": alone_med,
        "error_alone_pct": 100 * (alone_med / real_med - 1) if alone_med else None,
        "paired_error_pct": [100 * p for p in paired], "real_noise_p10_p90_pct": real_noise,
        # per round: emulated vs the real run before it only (the design before bracketing), and how far the
        # real job moved between the run before and the run after the emulation (the drift bracketing removes)
        "paired_error_before_only_pct": [100 * p for p in before_only],
        # with --lockstep: the same bracket's emulation with the shadow running back to back
        "paired_error_free_shadow_pct": free_paired,
        "paired_error_median_pct": 100 * statistics.median(paired),
        "real_drift_across_emulation_pct": drift,
        "real_across_rounds_pct": across,
        "emulated_noise_p10_p90_pct": statistics.median(100 * max(rk["noise_p10_p90"] for rk in e["ranks"])
                                                         for e in emus),
        "emulated_comm_s": statistics.median(max(rk["comm_s"] for rk in e["ranks"]) for e in emus),
        "emulated_wait_s": statistics.median(max(rk["wait_s"] for rk in e["ranks"]) for e in emus),
        "emulated_straggler_wait_s": statistics.median(max(rk.get("straggler_wait_s") or 0.0 for rk in e["ranks"])
                                                       for e in emus),
        # the same emulation without the straggler term (side by side, so its share is visible)
        "error_no_straggler_pct": 100 * (statistics.median(
            e["iteration_time_s"] - max(rk.get("straggler_wait_s") or 0.0 for rk in e["ranks"]) for e in emus)
            / real_med - 1),
        "emulated_per_call_wait_s": statistics.median(max(rk.get("per_call_wait_s") or 0.0 for rk in e["ranks"])
                                                      for e in emus),
        # the same emulation with the simpler wait model (the whole-step straggler term only, no per-call
        # waits): the waits are additive in a one-class timeline, so this is iteration - added + estimate
        "error_without_call_waits_pct": 100 * (statistics.median(
            e["iteration_time_s"] - max((rk.get("per_call_wait_s") or 0.0) + (rk.get("straggler_wait_s") or 0.0)
                                        - (rk.get("straggler_estimate_s") or rk.get("straggler_wait_s") or 0.0)
                                        for rk in e["ranks"]) for e in emus) / real_med - 1),
        "emulated_collective_calls": e0["ranks"][0]["collective_calls_per_step"],
        # the same emulation with the collectives priced by the calibrated curves instead of replayed
        "error_curves_pct": _curves_error(emus, real_med),
        "predict_s": _pred_time(pred), "roofline_s": _pred_time(roof),
        "predict_error_pct": 100 * (_pred_time(pred) / real_med - 1) if _pred_time(pred) else None,
        # predict on the cpu profile is the N-device program in series on one pinned core (its calibration
        # regime); its per-rank share compares with one real rank's process CPU per step
        "predict_per_rank_s": _pred_time(pred) / N_RANKS if _pred_time(pred) else None,
        "roofline_error_pct": 100 * (_pred_time(roof) / real_med - 1) if _pred_time(roof) else None,
        "memory_real_per_rank_bytes": [m["peak_bytes"] for m in mem_real],
        "memory_emulated_exact_bytes": exact, "memory_standin_program_bytes": standin,
        "memory_error_bytes": (exact - max(m["peak_bytes"] for m in mem_real)) if exact else None,
        "memory_standin_error_pct": 100 * (standin / max(m["peak_bytes"] for m in mem_real) - 1),
        "put_batch_workaround": reals[0]["put_batch_workaround"],
        **_cpu_view(reals, emus),
        "predict_per_rank_vs_real_cpu_pct": (100 * (_pred_time(pred) / N_RANKS / _cpu_view(reals, emus)["real_cpu_s"] - 1)
                                             if _pred_time(pred) and _cpu_view(reals, emus)["real_cpu_s"] else None),
        "predict_raw": {k: pred.get(k) for k in ("step_time_s", "backend", "method", "error") if k in pred},
    }
  return per


def committed_runs(path: str = "benchmarks/data/emulate_validate.json"):
  """(short commit, commit time ISO, the run's JSON) of every committed version of this benchmark's output,
  newest first: the record of all runs, read back from git (the working file keeps only the last)."""
  log = subprocess.run(["git", "log", "--format=%h %cI", "--", path], capture_output=True, text=True, check=True,
                       cwd=ROOT).stdout
  for line in filter(None, log.split("\n")):
    h, when = line.split()
    yield h, when, json.loads(subprocess.run(["git", "show", f"{h}:{path}"], capture_output=True, text=True,
                                             check=True, cwd=ROOT).stdout)


def _bracket(before: dict, after) -> float:
  """The real job's step time around an emulation: the mean of the real runs before and after it."""
  return before["median"] if not after else 0.5 * (before["median"] + after["median"])


def _curves_error(emus: list, real_med: float):
  its = [max(rk["iteration_time_s_curves"] for rk in e["ranks"]) for e in emus
         if all(rk.get("iteration_time_s_curves") for rk in e["ranks"])]
  return 100 * (statistics.median(its) / real_med - 1) if its else None


def _cpu_view(reals: list, emus: list) -> dict:
  """Process CPU time per step (all threads), real vs emulated: the work each rank does, without the
  time slices other users' processes took (see README: on this shared host wall time is mostly that)."""
  rc = [max(m for m in x.get("cpu_median_per_rank", []) if m) for x in reals if any(x.get("cpu_median_per_rank", []))]
  ec = [max(statistics.median(rk["step_cpu_s"]) for rk in e["ranks"] if rk.get("step_cpu_s"))
        for e in emus if any(rk.get("step_cpu_s") for rk in e["ranks"])]
  if not rc or not ec:
    return {"real_cpu_s": None, "emulated_cpu_compute_s": None}
  return {"real_cpu_s": statistics.median(rc), "emulated_cpu_compute_s": statistics.median(ec),
          "cpu_ratio_emulated_compute_over_real": statistics.median(ec) / statistics.median(rc)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--layouts", default="data,tensor,pipeline")
  ap.add_argument("--steps", type=int, default=14)
  ap.add_argument("--warmup-steps", type=int, default=4, help="real-run steps dropped (the first is compile)")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--no-alone", action="store_true",
                  help="skip the side-by-side emulation that times the rank alone (no shadow of its co-located peer)")
  ap.add_argument("--no-calibrate", action="store_true", help="use the stored gloo calibration as is")
  ap.add_argument("--gloo-when", choices=("emulation", "round"), default="emulation",
                  help="re-measure the gloo curves right before each emulation, only the kinds its layout uses "
                       "(default), or once per round for every kind")
  ap.add_argument("--gloo-reps", type=int, default=9, help="repetitions per gloo curve point (median)")
  ap.add_argument("--no-bracket", action="store_true",
                  help="compare each emulation with the real run before it only (no second real run after it)")
  ap.add_argument("--trace-nodes", action="store_true",
                  help="emulate with --trace-nodes (the measured step split by traced instruction times, not roofline)")
  ap.add_argument("--lockstep", action="store_true",
                  help="emulate with --lockstep-shadows (the peer's shadow starts each step with the measured rank)")
  ap.add_argument("--replay", action="store_true",
                  help="emulate with --replay-collectives (the program's own 2-rank calls timed between 2 gloo "
                       "processes); the curve-priced iteration is reported beside it")
  ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "data", "emulate_validate.json"))
  ap.add_argument("--no-predict", action="store_true", help="skip the predict / roofline columns")
  ap.add_argument("--reaggregate", default=None, help="recompute the summary from a saved JSON (no runs)")
  a = ap.parse_args(argv)
  a.argv = argv
  if a.reaggregate:
    with open(a.reaggregate) as f:
      saved = json.load(f)
    return _finish(saved["raw_rounds"], list(saved["layouts"]), a, time.perf_counter(),
                   previous=saved["layouts"])
  t0 = time.perf_counter()
  layouts = a.layouts.split(",")
  rounds = []
  for r in range(a.rounds):
    cal = None
    if not a.no_calibrate and a.gloo_when == "round":
      cal = gloo_calibration.calibrate(reps=a.gloo_reps, k=4)
    order = layouts[r % len(layouts):] + layouts[:r % len(layouts)]
    row = {"round": r, "order": order, "calibration_load": cal and cal["load_avg_1m"], "layouts": {}}
    for lay in order:
      real = run_real(lay, a.steps, a.warmup_steps)
      if not a.no_calibrate and a.gloo_when == "emulation":
        # the collective curves this emulation prices its calls with, measured a minute before it
        cal = gloo_calibration.calibrate(reps=a.gloo_reps, k=4, kinds=LAYOUT_KINDS.get(lay, gloo_calibration.KINDS))
        row.setdefault("calibration_load_per_layout", {})[lay] = cal["load_avg_1m"]
      emu = run_emulated(lay, a.repeats, 2, exact_memory=(r == 0), colocated=2, replay=a.replay,
                         trace_nodes=a.trace_nodes, lockstep=a.lockstep)
      row["layouts"][lay] = {"real": real, "emulated": emu}
      if a.lockstep:  # side by side inside the same bracket: the shadow running back to back (the default)
        row["layouts"][lay]["emulated_free"] = run_emulated(lay, a.repeats, 2, exact_memory=False, colocated=2,
                                                            replay=a.replay, trace_nodes=a.trace_nodes)
      if not a.no_bracket:
        row["layouts"][lay]["real_after"] = run_real(lay, a.steps, a.warmup_steps)
      if not a.no_alone:
        row["layouts"][lay]["emulated_alone"] = run_emulated(lay, a.repeats, 2, exact_memory=False, colocated=1,
                                                             replay=a.replay, trace_nodes=a.trace_nodes)
      after = row["layouts"][lay].get("real_after", {}).get("median", float("nan"))
      print(f"round {r} {lay}: real {real['median']:.4f}s emulated {emu['iteration_time_s']:.4f}s real after "
            f"{after:.4f}s (alone "
            f"{row['layouts'][lay].get('emulated_alone', {}).get('iteration_time_s', float('nan')):.4f}s)",
            file=sys.stderr)
    rounds.append(row)
  return _finish(rounds, layouts, a, t0)


def _finish(rounds, layouts, a, t0, previous=None) -> int:
  per = aggregate(rounds, layouts, predict=previous is None and not getattr(a, "no_predict", False),
                  previous=previous)
  mean_abs = statistics.mean(abs(v["error_pct"]) for v in per.values())
  mean_abs_paired = statistics.mean(abs(v["paired_error_median_pct"]) for v in per.values())
  mean_abs_no_straggler = statistics.mean(abs(v["error_no_straggler_pct"]) for v in per.values())
  without_call_waits = statistics.mean(abs(v["error_without_call_waits_pct"]) for v in per.values())
  curves = [v.get("error_curves_pct") for v in per.values()]
  mean_abs_curves = statistics.mean(abs(c) for c in curves) if all(c is not None for c in curves) else None
  out = {"benchmark": "emulate_validate", **provenance.stamp("benchmarks.emulate_validate", getattr(a, "argv", None)),
         "processes": 2,
         "four_processes": "not run: the host has 2 cores, and each process needs its own core",
         "mean_abs_error_pct": mean_abs, "mean_abs_error_no_straggler_pct": mean_abs_no_straggler,
         "mean_abs_error_curves_pct": mean_abs_curves,
         # the same emulations with the simpler wait model (no per-call waits, the whole straggler term)
         "mean_abs_error_without_call_waits_pct": without_call_waits,
         # per round, emulated vs the real runs bracketing it; the median over rounds per layout, |.| averaged
         "mean_abs_paired_error_pct": mean_abs_paired,
         "target_pct": 2.0, "layouts": per, "rounds": len(rounds),
         "gloo": (f"curves re-measured {'before each emulation' if getattr(a, 'gloo_when', 'round') == 'emulation' else 'once per round'}, "
                  f"median of {getattr(a, 'gloo_reps', 5)}"),
         "flags": " ".join(f for f, on in (("--trace-nodes", getattr(a, "trace_nodes", False)),
                                           ("--replay", getattr(a, "replay", False)),
                                           ("--no-bracket", getattr(a, "no_bracket", False)),
                                           ("--no-alone", getattr(a, "no_alone", False)),
                                           ("--lockstep", getattr(a, "lockstep", False))) if on),
         "wall_s": time.perf_counter() - t0, "load_avg_1m_end": os.getloadavg()[0]}
  with open(a.json, "w") as f:
    json.dump({**out, "raw_rounds": rounds}, f, indent=1, default=str)
  try:
    spec = importlib.util.spec_from_file_location("fig", os.path.join(ROOT, "experiments", "figures",
                                                                      "emulate_validate.py"))
    fig = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fig)
    out["png"] = fig.plot(a.json, os.path.join(ROOT, "benchmarks", "emulate_validate.png"))
  except Exception as e:  # noqa: BLE001 - the numbers matter more than the figure
    out["png_error"] = repr(e)
  print(json.dumps(out, default=str))
  return 0


def _fmt(x):
  return "n/a" if x is None else f"{x * 1e3:.1f} ms"


def _fmtl(xs):
  return "n/a" if not xs else "/".join(f"{x:+.1f}" for x in xs)


def _fmtp(x):
  return "n/a" if x is None else f"{x:+.0f}%"


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--child-real":
    child_real(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    sys.exit(0)
  sys.exit(main())
