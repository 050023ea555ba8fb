"""emulate(): a training step at the target scale from one real device (PrismLLM-style hybrid emulation).

  per-rank program (rank_program) -> slicing into classes of ranks with distinct programs (slicing)
  -> each representative rank runs for real with stand-in collectives (measure)
  -> its timeline on the execution graph with modelled collectives (timeline.rank_timeline)
  -> classes aligned at their synchronising collectives (timeline.compose) -> JSON + Perfetto traces.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

from framework.config import Config
from framework import xla_flags
from perfmodel import hardware as hw_lib
from perfmodel import predict
from perfmodel.cost import collectives as coll_model
from perfmodel.emulate import gloo_calibration as gc
from perfmodel.emulate import at_scale, measure, rank_program, shadow, slicing, trace
from perfmodel.emulate import timeline as tl_lib

EXACT_MEMORY_MAX_DEVICES = 1024  # XLA:CPU compiles up to here on virtual devices; 8192 is refused (measured)


def target_compile_memory(config_spec: str, overrides: Sequence[str], n: int, timeout_s: float = 600.0) -> dict:
  """Per-device memory of the *real* N-device program, compiled on N virtual CPU devices in a child
  process (XLA_FLAGS must be set before jax starts). Byte-exact for the CPU compiler."""
  env = dict(os.environ, XLA_FLAGS=xla_flags.with_host_device_count(n), JAX_PLATFORMS="cpu")
  code = ("import json,sys; from framework import config_file, config as C; from perfmodel import program; "
          "cfg=C.validate(config_file.load(sys.argv[1], sys.argv[2:]), %d); c=program.train_step(cfg); "
          "print('@@'+json.dumps(dict(c.memory, compile_s=c.compile_s)))" % n)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  p = subprocess.run([sys.executable, "-c", code, config_spec, *overrides], env=env, capture_output=True,
                     text=True, timeout=timeout_s, cwd=root)
  for line in p.stdout.splitlines():
    if line.startswith("@@"):
      return json.loads(line[2:])
  raise RuntimeError(f"target compile on {n} virtual devices failed: {p.stderr[-2000:]}")


def shrunk_branch_traces(cfg: Config, ranks: Sequence[int], n_cond_sites: dict) -> tuple:
  """Branch traces for a compile-only emulation: which runtime branch each ``cond`` took is decided by
  the pipeline schedule and the rank's stage, not by the model's sizes. So a copy of the program with
  the same mesh, schedule, micro-batches, layer count and remat but tiny widths and sequence runs once
  per rank (seconds) and its trace is used for the full-size program. Used only when the copy has the
  same cond sites as the full program (checked per rank); returns ({rank: trace}, notes)."""
  m = cfg.mesh
  w = 8 * max(m.tensor, 1) * max(m.fsdp, 1) * max(m.data, 1)  # divisible by every sharding of a width
  model = dataclasses.replace(cfg.model, vocab_size=w, d_model=w, n_heads=max(m.tensor, 1), n_kv_heads=max(m.tensor, 1),
                     head_dim=8, d_ff=w, max_seq_len=8 * max(m.sequence, 1), dtype="float32", param_dtype="float32")
  data = dataclasses.replace(cfg.data, seq_len=8 * max(m.sequence, 1))
  small = dataclasses.replace(cfg, model=model, data=data)
  prog = rank_program.build(small)
  out, notes = {}, []
  for r in ranks:
    state = rank_program.random_state(prog)
    inputs, targets = rank_program.random_batch(prog)
    trace, n = measure.count_branches(prog, r, state, inputs, targets)
    if n != n_cond_sites.get(r):
      notes.append(f"rank {r}: shrunk copy has {n} cond sites, the full program {n_cond_sites.get(r)}: branches "
                   f"priced by their costliest branch")
      continue
    out[r] = trace
  return out, notes


def _calls_to_replay(timelines) -> list:
  """Distinct 2-rank collective calls of the timelines, each with the median compute before it."""
  by_key = {}
  for tl in timelines:
    for e in tl.events:
      if e.cat != "comm" or e.args.get("group_size") != 2 or "sizes" not in e.args:
        continue
      key = coll_model.call_key(e.args["kind"], e.args["sizes"])
      by_key.setdefault(key, (e.args["kind"], e.args["sizes"], []))[2].append(e.args["compute_before_s"])
  return [{"kind": k, "sizes": s, "burst_s": statistics.median(b)} for k, s, b in by_key.values()]


def emulate(cfg: Config, ranks: Optional[Sequence[int]] = None, hardware: str = "cpu", local_hardware: str = "cpu",
            out_dir: Optional[str] = None, repeats: int = 5, warmup: int = 1, execute: bool = True,
            exact_memory: Optional[tuple] = None, notes: Sequence[str] = (), algorithm: str = "auto",
            host_data: bool = True, combine: bool = True, gloo_calibration: Optional[str] = "auto",
            colocated: int = 1, stragglers: bool = True, replay_collectives: bool = False,
            trace_nodes: bool = False, lockstep_shadows: bool = False, framework: Optional[str] = None,
            topology: Optional[str] = None) -> dict:
  """Emulates one training step of ``cfg`` (validated at its target mesh). ``ranks``: None = one per
  class of distinct programs; else these ranks run for real (plus one per class they leave uncovered).
  ``exact_memory``: (config_spec, overrides) to also compile the real N-device program for its
  byte-exact per-device memory (N <= EXACT_MEMORY_MAX_DEVICES). ``gloo_calibration``: for the ``cpu``
  target, price collectives by the measured 2-process gloo curves (perfmodel/emulate/gloo_calibration.py;
  'auto' = the stored file when present, None = the profile's own curves). ``colocated``: how many of the
  target job's ranks share one host's memory system (CPU hosts); the real rank is then timed while
  ``colocated - 1`` shadow processes replay its peers' load on the other cores (perfmodel/emulate/shadow.py).
  ``stragglers``: when the rank runs on the target's device kind, add the wait for the slowest of the job's
  ranks, with the peers varying like the measured rank's steps (``straggler_estimate_s``; what is added,
  ``straggler_wait_s``, is what it exceeds the per-call waits by).
  ``replay_collectives``: for the ``cpu`` target, time the program's own 2-rank collective calls between 2
  real gloo processes on this host (``gloo_calibration.replay``) instead of pricing them from the curves;
  each call among symmetric peers then also gets the measured wait for the later peer
  (``timeline.add_call_waits``; ``per_call_wait_s`` per step).
  ``trace_nodes``: split each rank's measured step over its instructions by their traced in-program times
  (XLA TraceMe; ``perfmodel.cost.trace_nodes.enable()`` must have run before jax started) instead of by roofline.
  Compile only on a TPU / GPU target: the target-compiled program priced as ``predict`` prices it
  (perfmodel/emulate/at_scale.py; ``framework``: its XLA flags and overlap options, ``topology``: the target's
  shape)."""
  t0 = time.perf_counter()
  target_hw, local_hw = hw_lib.load(hardware), hw_lib.load(local_hardware)
  if not execute and predict.is_target(target_hw):
    return at_scale.emulate_target(cfg, target_hw.name, ranks, out_dir, framework=framework, topology=topology,
                                   notes=notes)
  notes = list(notes)
  coll_source = "profile %s" % target_hw.name
  if gloo_calibration and target_hw.device_kind == "cpu":
    target_hw, cal = gc.with_gloo_curves(target_hw, gc.current_path() if gloo_calibration == "auto" else gloo_calibration)
    if cal is not None:
      coll_source = cal["source"]
  prog = rank_program.build(cfg)
  space = prog.space
  sl = slicing.slice_ranks(prog.body, space, ranks)
  to_run = list(dict.fromkeys(list(ranks or []) + [c.representative for c in sl.classes]))
  runs = {}
  shadow_cores = shadow.colocated_cores(colocated) if execute and colocated > 1 else []
  if execute and colocated > 1 and len(shadow_cores) < colocated - 1:
    notes.append(f"{colocated} co-located ranks requested but only {len(shadow_cores)} other cores: "
                 f"{len(shadow_cores)} shadow processes")
  for r in to_run:
    with (shadow.Shadows(cfg, r, shadow_cores, lockstep=lockstep_shadows) if shadow_cores
          else contextlib.nullcontext()) as shadows:
      runs[r] = measure.run_rank(prog, r, repeats=repeats, warmup=warmup, execute=execute, host_data=host_data,
                                 trace_nodes=trace_nodes and execute,
                                 before_step=shadows.step if shadows is not None else None)  # no-op unless lockstep
  skipped = [r for r in to_run if execute and not runs[r].executed]
  notes += [runs[r].not_run for r in skipped]
  for r in skipped:
    print(runs[r].not_run, file=sys.stderr, flush=True)
  execute = execute and not skipped  # one rank too big for this host: every class priced, none timed
  branch_source = "counted (execution)" if execute else "none"
  if not execute and any(runs[r].n_cond_sites for r in to_run):
    traces, extra = shrunk_branch_traces(cfg, [r for r in to_run if not runs[r].branch_trace],
                                         {r: runs[r].n_cond_sites for r in to_run})
    notes += extra
    for r, tr in traces.items():
      runs[r].branch_trace = tr
    branch_source = "counted on a shrunk copy (same mesh, schedule, layers; tiny widths)"
  straggle = {}
  if stragglers and execute and target_hw.device_kind == local_hw.device_kind:
    # A synchronous step lasts as long as its slowest rank. Virtual peers are taken to vary from step to step
    # like the measured rank does: the wait is the median over steps of the max over the job's ranks, minus
    # the median of its measured steps (medians on both sides, as iteration times are reported).
    for r in to_run:
      xs = runs[r].step_times_s
      if len(xs) >= 3:
        straggle[r] = max(0.0, tl_lib.median_max(xs, space.n) - statistics.median(xs))
  reps = {c.label: c.representative for c in sl.classes}

  call_waits = {}  # replayed calls: a rank's expected wait for its symmetric peer at each (add_call_waits)
  per_call, straggle_added = {}, {}

  def timelines(hw) -> dict:
    out = {}
    for r in to_run:
      measured = runs[r].compute_s if execute else 0.0
      out[r] = tl_lib.rank_timeline(r, runs[r].hlo_text, runs[r].records, measured if measured == measured else 0.0,
                                    space, hw, local_hw, algorithm, branch_trace=runs[r].branch_trace,
                                    combine=combine, compute_hw=None if execute else hw,
                                    node_times=runs[r].node_times)
      out[r], per_call[r] = tl_lib.add_call_waits(out[r], call_waits, sl.structural)
    composed = tl_lib.compose({lab: out[r] for lab, r in reps.items()}, sl.structural)
    for lab, r in reps.items():
      out[r] = composed[lab]
    for r, w in straggle.items():
      # The per-call waits already hold the step's wait for its slowest peer (a sum of per-segment maxima is
      # at least the maximum of the sums): only what the whole-step estimate exceeds them by is added.
      straggle_added[r] = max(0.0, w - per_call.get(r, 0.0))
      out[r] = tl_lib.add_straggler_wait(out[r], straggle_added[r])
    return out
  tls = timelines(target_hw)
  replayed, curve_iteration = None, {}
  if replay_collectives and execute and target_hw.device_kind == "cpu":
    calls = _calls_to_replay(tls.values())
    t_replay = time.perf_counter()
    table, both = gc.replay(calls, reps=9, per_process=True)  # 9, not 5: the spread between the processes is used
    curve_iteration = {r: tl.iteration_s for r, tl in tls.items()}
    target_hw = dataclasses.replace(target_hw, collective_calls=table)
    # The process that arrived first at a call measured the transfer plus its wait for the other one, the
    # later one the transfer alone (the table: the min). Symmetric peers are each the later one half the
    # time, so a rank's expected wait at the call is the mean over the two minus the min.
    call_waits.update({k: statistics.mean(ts) - min(ts) for k, ts in both.items()})
    tls = timelines(target_hw)
    replayed = {"calls": len(table), "wall_s": time.perf_counter() - t_replay, "seconds": dict(table),
                "seconds_per_process": both, "burst_s": {coll_model.call_key(c["kind"], c["sizes"]): c["burst_s"]
                                                         for c in calls}}
    coll_source += f"; {len(table)} 2-rank call(s) replayed between 2 gloo processes (gloo_calibration.replay)"
  exact = None
  if exact_memory is not None and space.n <= EXACT_MEMORY_MAX_DEVICES:
    exact = target_compile_memory(exact_memory[0], exact_memory[1], space.n)
  per_rank = []
  for r in to_run:
    run, tl = runs[r], tls[r]
    cls = sl.class_of(r)
    mem = exact["peak_bytes"] if exact else run.memory["peak_bytes"]
    per_rank.append({
        "rank": r, "coords": space.coords(r), "class": cls.label, "class_size": cls.count,
        "iteration_time_s": tl.iteration_s,
        "compute_source": tl.compute_source, "collective_calls_per_step": tl.collective_calls,
        "branches_taken": tl.branches, "untraced_branch_executions": tl.untraced_branches,
        "cond_sites": run.n_cond_sites, "host_data": run.host_data,
        "compute_s": tl.compute_s, "comm_s": tl.comm_s, "wait_s": tl.wait_s,
        # the whole-step estimate, what of it was added beyond the per-call waits, and those
        "straggler_estimate_s": straggle.get(r), "straggler_wait_s": straggle_added.get(r),
        "per_call_wait_s": per_call.get(r, 0.0),
        "iteration_time_s_curves": curve_iteration.get(r),  # with replay: the same rank priced by the curves
        "measured_standin_program_s": run.compute_s if execute else None,
        "standin_local_s": tl.standin_local_s, "noise_p10_p90": run.noise, "step_times_s": run.step_times_s,
        "step_cpu_s": run.step_cpu_s,
        "peak_memory_bytes": mem,
        "memory_source": "target N-device compile (exact)" if exact else "compiled per-rank program at real shapes",
        "per_rank_program_memory": run.memory, "collective_sites": len(run.records),
        "collective_bytes_per_step": sum(x.bytes * x.trips for x in run.records),
        "comm_by_kind_s": tl.by_kind, "unplaced_collectives": tl.unplaced, "compile_s": run.compile_s,
        "loss": run.loss})
  iteration = max((p["iteration_time_s"] for p in per_rank if p["iteration_time_s"] is not None), default=None)
  result = {
      "emulated_devices": space.n, "real_devices": 1, "mesh": space.axis_sizes, "config": cfg.name,
      "hardware": hardware, "local_hardware": local_hardware, "local_device": next(iter(runs.values())).device,
      "iteration_time_s": iteration, "peak_memory_bytes": max(p["peak_memory_bytes"] for p in per_rank),
      "ranks": per_rank,
      "slicing": {"structural_axes": list(sl.structural), "assumption": sl.assumption,
                  "classes": [{"class": c.label, "representative": c.representative, "ranks": c.count,
                               "chosen_by": c.chosen_by} for c in sl.classes]},
      "per_rank_params": prog.n_params_local, "trace_s": prog.trace_s, "executed": execute,
      "exact_memory": exact, "collective_model": coll_source, "replayed_collectives": replayed,
      "compute_split": ("traced in-program instruction times (XLA TraceMe)" if any(runs[r].node_times for r in to_run)
                        else "roofline shares of the measured step"),
      "colocated_ranks": colocated, "interference": (f"{len(shadow_cores)} shadow process(es) on cores {shadow_cores}"
                                                     + (", in lockstep with the rank's steps" if lockstep_shadows else "")
                                                     if shadow_cores else "none (rank timed alone)"), "branch_trace_source": branch_source, "combine_collectives": combine,
      "notes": notes + ([] if execute else [
          "compile only: compute time is modelled (roofline of the target profile on the per-rank graph), not "
          "measured"]),
      "wall_time_s": None, "trace_files": []}
  if out_dir:
    labels = [(f"rank {r} ({sl.class_of(r).label})", tls[r]) for r in to_run]
    result["trace_files"] = trace.write(out_dir, labels, {"mesh": space.describe(), "config": cfg.name,
                                                          "hardware": hardware})
  result["wall_time_s"] = time.perf_counter() - t0
  if out_dir:
    with open(os.path.join(out_dir, "emulation.json"), "w") as f:
      json.dump(result, f, indent=1, default=str)
  return result
