"""The calibration programs, node by node: what the learned and hybrid backends learn from.

For every entry of perfmodel/calib/suite.py ``CALIBRATION`` (training steps whose shapes differ from the validation
suite) and ``CALIBRATION_INFER`` (KV-cached samplers): compile the real program and time every instruction inside
it with XLA's TraceMe (perfmodel/cost/trace_nodes.py). One sample per (program, node): its class, log features,
in-program times and the calibrated-curve ("physical") estimate the learned backend scales by. Node samples come
from single-device programs only: with N virtual devices on one core a sibling device's thread preempts a thunk
mid-flight and its traced wall time overstates the work.

:func:`run` gathers the programs (graphs, step times, samples) and chooses the learned backend and its composition
(perfmodel/calib/fit.py).
"""
from __future__ import annotations

import statistics

import numpy as np

from framework import host_memory
from perfmodel import compose, pipeline, program
from perfmodel.calib import bench, fit, runners, suite
from perfmodel.cost import trace_nodes
from perfmodel.cost import chain as chain_lib
from perfmodel.cost import learned
from perfmodel.cost.physical import Calibrated
from perfmodel.graph.from_hlo import from_hlo_text
from perfmodel.graph.nodes import COMPUTE_KINDS, mark_decode
from perfmodel.hardware import load as load_profile


def node_samples(g, traced: dict, prog: str, phys, sampler: bool = False) -> list:
  """One learned-backend sample per distinct timed compute node of graph ``g``; a ``sampler`` program's samples
  carry the decode class (cost/learned.py: they are the neighbours of decode nodes)."""
  out, seen = [], set()
  for n, _ in g.walk():
    if n.kind not in COMPUTE_KINDS or n.name not in traced or n.name in seen:
      continue
    seen.add(n.name)
    p = phys.price(n)
    ts = traced[n.name]
    out.append({"prog": prog, "cls": learned.base_class(n) + (learned.DECODE if sampler else ""),
                "f": learned.features(n), "t": trace_nodes.quantile(ts, 0.25), "t50": trace_nodes.quantile(ts, 0.5),
                "tm": float(np.mean(ts)), "phys": p.seconds if p else 0.0, "P": n.program_bytes, "name": n.name,
                "fp": n.fingerprint})
  return out


def resolve_branches(g, cfg, hw) -> None:
  """A pipelined program's slots as predict resolves them (stage average), so its composition row sees the work
  that runs, not the idle branches."""
  pipeline.resolve(g, chain_lib.make_chain(hw, "roofline"), pipeline.schedule_of(cfg), stage=None)


def _trace_train(cfg, cap, hw, phys, trace_reps) -> tuple:
  """(graph, node samples) of a compiled training step (no samples from a multi-device program)."""
  g = from_hlo_text(cap.hlo_text, cap.n_devices)
  resolve_branches(g, cfg, hw)
  if cap.n_devices != 1:
    return g, []
  run_fn = runners.train_runner(cap, cfg)
  for _ in range(2):
    run_fn()
  traced = trace_nodes.traced_times(run_fn, reps=trace_reps, names={n.name for n, _ in g.walk()})
  return g, node_samples(g, traced, cfg.name, phys)


def _trace_decode(entry, cfg, phys, trace_reps) -> tuple:
  run2, cap = runners.infer_runner(cfg, entry["batch"], entry["prompt_len"], entry["gen_lens"][1])
  g = from_hlo_text(cap.hlo_text, 1)
  traced = trace_nodes.traced_times(run2, reps=trace_reps, names={n.name for n, _ in g.walk()})
  return g, node_samples(g, traced, entry["name"], phys, sampler=True)


def trace_programs(prof_path: str, trace_reps: int = 3) -> dict:
  """{program: node samples} of every one-device calibration program, traced in this process (the ``trace`` child,
  which has exactly one virtual device as a one-device job does)."""
  hw = load_profile(prof_path)
  phys = Calibrated(hw)
  out = {}
  for entry in suite.CALIBRATION:
    cfg, n, _ = runners.entry_cfg(entry)
    if n == 1:
      out[entry["name"]] = _trace_train(cfg, program.train_step(cfg, keep_compiled=True), hw, phys, trace_reps)[1]
  for entry in suite.CALIBRATION_INFER:
    out[entry["name"]] = _trace_decode(entry, runners.entry_cfg(entry)[0], phys, trace_reps)[1]
  return out


def devices_of(entry: dict) -> int:
  return runners.entry_cfg(entry)[1]


def pool_traced(rounds: list) -> dict:
  """{program: node samples} pooled over several trace children: a node's statistics (learned.STATS) are the
  medians over the children that timed it. In-program node times move together by up to 1.45x between fresh
  processes while the program's step time does not, so one child's samples would carry that child's offset."""
  out = {}
  for prog in dict.fromkeys(p for r in rounds for p in r):
    by_name = {}
    for r in rounds:
      for s in r.get(prog, []):
        by_name.setdefault(s["name"], []).append(s)
    pooled = []
    for ss in by_name.values():
      s = dict(ss[0])
      for stat in learned.STATS:
        xs = [x[stat] for x in ss if stat in x]
        if xs:
          s[stat] = float(statistics.median(xs))
      s["children"] = len(ss)
      pooled.append(s)
    out[prog] = pooled
  return out


def _decode_program(entry, hw, phys, samples, reps, trace_reps, log, given_samples: list = None) -> dict:
  """A calibration decode program: TPOT = slope of two generation lengths; nodes traced at the longer one (here,
  or in a child: ``given_samples``; then its TPOT comes from the measuring child too)."""
  cfg = runners.entry_cfg(entry)[0]
  g1, g2 = entry["gen_lens"]
  if given_samples is not None:
    g = from_hlo_text(program.sampler(cfg, entry["batch"], entry["prompt_len"], g2).hlo_text, 1)
    new, tpot, noise = given_samples, float("nan"), float("nan")
  else:
    g, new = _trace_decode(entry, cfg, phys, trace_reps)
    run1, _ = runners.infer_runner(cfg, entry["batch"], entry["prompt_len"], g1)
    run2, _ = runners.infer_runner(cfg, entry["batch"], entry["prompt_len"], g2)
    r = bench.time_slope(run1, run2, g1, g2, reps=reps, min_time=runners.TPOT_MIN_TIME_S)
    tpot, noise = bench.seconds(r), bench.spread_pct(bench.view(r))
    log(f"calibrate {entry['name']:>18}: {len(new)} nodes traced, TPOT {tpot * 1e3:.3f} ms (±{noise:.1f}%)")
  samples.extend(new)
  loop = runners.decode_loop(g, g2)
  mark_decode(g, loop.body if loop else None)
  return {"name": entry["name"], "graph": g, "n": 1, "measured": tpot, "noise": noise,
          "region": loop.body if loop else None}


def run(hw, reps: int = 7, trace_reps: int = 3, entries: list = None, log=print, infer: bool = True,
        step_times: dict = None, traced: dict = None) -> dict:
  """The calibration programs, their node samples, and the learned backend fitted on them (fit.select_learned).
  ``step_times``: {program: measurement} from measuring children; they replace steps timed here. ``traced``:
  {program: node samples} from trace children; programs not in it are traced here."""
  entries = entries if entries is not None else suite.CALIBRATION
  # Node samples are traced with malloc keeping freed blocks, so no sample carries the page faults of a fresh temp
  # buffer (which instruction pays them is an accident of the buffer layout).
  log("calibrate: malloc keeps freed blocks while tracing (no per-step page faults): "
      f"{host_memory.keep_freed_memory()}")
  # whether the fresh-temp term has anything to fit depends on the allocator regime of the step times
  keeps = (all(v["regime"]["host_malloc"] == "keep_freed" for v in step_times.values()) if step_times
           else host_memory.state() == "keep_freed")
  samples, programs = [], []
  phys = Calibrated(hw)
  for entry in entries:
    cfg, n, _ = runners.entry_cfg(entry)
    given = (step_times or {}).get(entry["name"])
    if given and traced is not None and (entry["name"] in traced or n > 1):
      cap = program.train_step(cfg)  # measured and traced in children: the graph is all that is needed here
      g = from_hlo_text(cap.hlo_text, cap.n_devices)
      resolve_branches(g, cfg, hw)
      measured, noise, new = given["measured_s"], given["noise_pct"], traced.get(entry["name"], [])
    else:
      cap = program.train_step(cfg, keep_compiled=True)
      g, new = _trace_train(cfg, cap, hw, phys, trace_reps)
      if given:
        measured, noise = given["measured_s"], given["noise_pct"]
      else:
        r = bench.time_fn(runners.train_runner(cap, cfg), reps=reps, warmup=2)
        measured, noise = bench.seconds(r), bench.spread_pct(bench.view(r))
    samples.extend(new)
    programs.append({"name": entry["name"], "graph": g, "n": cap.n_devices, "measured": measured,
                     "noise": noise, "temp": cap.memory["temp_size_in_bytes"], "pow2": compose.pow2_tokens(cfg)})
    log(f"calibrate {entry['name']:>18}: {len(new)} nodes traced, step {measured * 1e3:.2f} ms "
        f"(±{programs[-1]['noise']:.1f}%, {cap.n_devices} dev)")
  for entry in (suite.CALIBRATION_INFER if infer else []):
    programs.append(_decode_program(entry, hw, phys, samples, reps, trace_reps, log,
                                    (traced or {}).get(entry["name"])))
  for p in programs:  # decode programs: the measuring child's TPOT replaces the in-process one
    if step_times and p["name"] in step_times:
      p["measured"] = step_times[p["name"]]["measured_s"]
      p["noise"] = step_times[p["name"]]["noise_pct"]
  res = fit.select_learned(hw, programs, samples, keeps, log)
  return {"samples": samples, **res, "noise_pct_median": float(statistics.median(p["noise"] for p in programs)),
          "host_malloc": "keep_freed" if keeps else "default"}
