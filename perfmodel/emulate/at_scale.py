"""Compile-only emulation on an accelerator target: every rank class priced from the target-compiled program.

When nothing runs (``--compile-only``) and the target is a TPU or GPU (parallelism/targets.py), the program a rank
runs is the step compiled for the target's compile-only devices: an SPMD program, one per-device HLO that every rank
runs, its pipeline-stage slots decided by the rank's stage. It is the program ``predict`` prices
(perfmodel/target.py, cached by the same key), priced by the same cost chain and timeline
(``perfmodel.predict.stage_timelines``): emulation and prediction are one pricing. What emulation adds is per rank:
the slicing into classes of ranks with distinct programs (perfmodel/emulate/slicing.py), each class's timeline
(its pipeline stage's program, then the lock-step wait for the busiest stage), the target compiler's per-chip
memory, and Perfetto traces.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import types
from typing import Optional, Sequence

from framework import flops as flops_lib
from framework.config import Config
from perfmodel import hardware as hw_lib
from perfmodel import predict, target
from perfmodel.cost import chain as chain_lib
from perfmodel.emulate import rank_program, slicing, trace
from perfmodel.graph import from_hlo
from perfmodel.timeline import Event


def emulate_target(cfg: Config, hardware: str, ranks: Optional[Sequence[int]] = None, out_dir: Optional[str] = None,
                   backend: str = "auto", framework: Optional[str] = None, topology: Optional[str] = None,
                   notes: Sequence[str] = ()) -> dict:
  """One training step of ``cfg`` (validated at its target mesh) on ``hardware``, nothing executed."""
  t0 = time.perf_counter()
  hw = hw_lib.load(hardware)
  # the per-rank body tells the classes of ranks apart (its control flow, not its kernels: a platform kernel is
  # traced as XLA's attention here, on the host)
  kernel = cfg.model.attention in ("cudnn", "splash")
  prog = rank_program.build(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="dot_product"))
                            if kernel else cfg)
  space = prog.space
  sl = slicing.slice_ranks(prog.body, space, ranks)
  t_trace = time.perf_counter() - t0
  cap = target.train_step(cfg, hw.name, topology, framework=framework)
  g = from_hlo.from_hlo_text(cap.hlo_text, cap.n_devices)
  chain = chain_lib.make_chain(hw, backend, framework=framework)
  chain.placement = cap.placement
  stages, cond_info = predict.stage_timelines(g, chain, hw, cfg, framework, record=True)
  by_stage = {st.stage: st for st in stages}
  overhead = hw.calibration.step_overhead_s
  to_run = list(dict.fromkeys(list(ranks or []) + [c.representative for c in sl.classes]))
  per_rank, labelled = [], []
  for r in to_run:
    coords, cls = space.coords(r), sl.class_of(r)
    st = by_stage[coords.get("pipeline") if None not in by_stage else None]
    tl = st.timeline
    comm = sum(v for k, v in tl.busy_by_kind.items() if k in ("collective", "p2p"))
    compute = sum(v for k, v in tl.busy_by_kind.items() if k not in ("collective", "p2p"))
    events = list(tl.events or [])
    if st.lockstep_idle_s:
      events.append(Event("wait (busiest stage, lock-step ticks)", "wait", tl.makespan, st.lockstep_idle_s))
    labelled.append((f"rank {r} ({cls.label})", types.SimpleNamespace(rank=r, events=events)))
    per_rank.append({
        "rank": r, "coords": coords, "class": cls.label, "class_size": cls.count, "stage": st.stage,
        "iteration_time_s": st.step_s + overhead, "compute_s": compute, "comm_s": comm,
        "exposed_comm_s": tl.exposed_comm, "wait_s": st.lockstep_idle_s, "overlap": st.overlap,
        "compute_source": f"target-compiled program priced by the cost chain {chain.names} "
                          f"(perfmodel.predict.stage_timelines)",
        "peak_memory_bytes": cap.memory["peak_bytes"],
        "memory_source": cap.memory.get("peak_source", "target compiler's memory_analysis")})
  iteration = max(p["iteration_time_s"] for p in per_rank)
  tokens = cfg.data.global_batch * cfg.data.seq_len
  model_flops = flops_lib.train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
  dtype = {"bfloat16": "bf16", "float16": "f16"}.get(cfg.model.dtype, "f32")
  result = {
      "emulated_devices": space.n, "real_devices": 0, "mesh": space.axis_sizes, "config": cfg.name,
      "hardware": hw.name, "iteration_time_s": iteration, "mfu": model_flops / iteration / (hw.peak(dtype) * space.n),
      "peak_memory_bytes": cap.memory["peak_bytes"], "ranks": per_rank,
      "slicing": {"structural_axes": list(sl.structural), "assumption": sl.assumption,
                  "classes": [{"class": c.label, "representative": c.representative, "ranks": c.count,
                               "chosen_by": c.chosen_by} for c in sl.classes]},
      "program": {"route": "target_compile", "devices": cap.n_devices, "compile_s": cap.lower_s + cap.compile_s,
                  "detail": cap.route_detail or None, "conditionals": cond_info},
      "executed": False, "trace_s": t_trace, "collective_model": f"profile {hw.name} (perfmodel/cost/collectives.py)",
      "notes": list(notes) + ["compile only on an accelerator target: every class is priced from the target-compiled "
                              "program with predict's cost chain, nothing measured"],
      "wall_time_s": None, "trace_files": []}
  if out_dir:
    result["trace_files"] = trace.write(out_dir, labelled, {"mesh": space.describe(), "config": cfg.name,
                                                            "hardware": hw.name})
  result["wall_time_s"] = time.perf_counter() - t0
  if out_dir:
    with open(os.path.join(out_dir, "emulation.json"), "w") as f:
      json.dump(result, f, indent=1, default=str)
  return result
