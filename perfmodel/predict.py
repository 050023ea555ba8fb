"""predict: config (+ overrides, mesh, hardware) -> step time, tokens/s, MFU, peak memory, breakdowns.

Training: the real compiled step (capture.train_step) -> execution graph -> cost chain -> timeline.
Inference: the real KV-cached sampler (capture.sampler) -> graph; everything before the decode loop
is the prefill (TTFT), one trip of the loop body is one decode step (TPOT).

Virtual CPU devices share the host's cores, so on the ``cpu`` profile a program replicated over N
virtual devices takes about N x its per-device time / host_parallelism (calibrated); on real
accelerators every device runs its copy in parallel and the per-device timeline is the step.
"""
from __future__ import annotations

import time

import numpy as np

from framework import flops as flops_lib
from framework.config import Config
from perfmodel import capture, costs, graph as graph_lib, memory, timeline
from perfmodel.hardware import HardwareProfile


def composed(g: graph_lib.ExecGraph, chain, hw: HardwareProfile, n_devices: int, region: str = None,
             per_step: bool = True, temp_bytes: float = 0.0, pow2: bool = False):
  """Step seconds from the calibrated composition (cpu profile, learned chain) or None.

  On this host the N virtual devices run their per-device programs on one pinned core, so per-node times
  add up over devices with a per-thunk gap and per-device and collective terms fitted by
  ``python -m perfmodel calibrate`` (perfmodel/calibrate_nodes.py)."""
  coef = composition_for(hw, chain)
  if not coef:
    return None
  from perfmodel import calibrate_nodes
  feats = calibrate_nodes.composition_features(g, lambda n: chain.price(n).seconds, n_devices, region, temp_bytes,
                                               hw=hw, pow2=pow2)
  if not per_step:
    feats[2] = 0.0
  return calibrate_nodes.compose(coef, feats, calibrate_nodes.program_type(n_devices, decode=not per_step))


def composition_for(hw: HardwareProfile, chain) -> dict:
  """The fitted composition matching the chain's first backend: ``composition`` (learned node prices, fitted
  by calibrate), ``composition_profiled`` or ``composition_hybrid`` (node prices of the profiled database as
  they are / times the in-program ratio, both fitted by ``calibrate --profiled``);
  None when the profile has none for it (the timeline's makespan is then the step)."""
  first = chain.names[0] if chain.names else ""
  key = costs.FITTED.get(first, (None,))[0]
  return hw.calibration.get(key) if key else None


def _host_factor(hw: HardwareProfile, n_devices: int) -> float:
  if hw.name != "cpu" or n_devices <= 1:
    return 1.0
  return n_devices / max(1.0, min(float(n_devices), hw.calibration.get("host_parallelism", 1.0)))


def price_graph(g: graph_lib.ExecGraph, hw: HardwareProfile, backend: str = "auto", algorithm: str = "auto"):
  chain = costs.make_chain(hw, backend, algorithm)
  return timeline.schedule(g, chain), chain


def _breakdown(tl: timeline.Timeline, scale: float) -> dict:
  return {
      "by_kind_s": {k: v * scale for k, v in sorted(tl.busy_by_kind.items())},
      "by_phase_s": {k: v * scale for k, v in sorted(tl.by_phase.items())},
      "by_layer_s": {(k or "other"): v * scale for k, v in sorted(tl.by_layer.items())},
      "exposed_comm_s": tl.exposed_comm * scale,
      "priced_by": tl.backend_counts,
      "top_nodes": [{"s": s * scale, "name": nm, "kind": kd, "backend": b, "op": op[-80:]}
                    for s, nm, kd, b, op in tl.top_nodes[:8]],
  }


def _resolve_and_schedule(g: graph_lib.ExecGraph, chain, hw: HardwareProfile, cfg: Config):
  """(timeline, lock-step idle seconds, how conditionals were resolved) of a training step.

  Pipelined programs decide their slots at run time (perfmodel/branches.py). On the ``cpu`` profile the N
  virtual devices run in series on one core, so the step is their *summed* work: branches weighted by the
  stage-average schedule, no lock-step idle. On parallel hardware each stage's own program is priced, plus
  the ticks it idles waiting for the busiest stage; the slowest stage is the step."""
  from perfmodel import branches  # noqa: PLC0415
  sched = branches.schedule_of(cfg)
  if sched is None or hw.name == "cpu":
    info = branches.resolve(g, chain, sched, stage=None)
    info["stages"] = "average over stages (N devices in series)" if sched is not None else None
    return timeline.schedule(g, chain), 0.0, info
  per_stage, slots = [], []
  for s in range(sched.n_stages):
    info = branches.resolve(g, chain, sched, stage=s)
    per_stage.append(timeline.schedule(g, chain))
    slots.append(branches.slot_work(g, chain))
  f, b = [x[0] for x in slots], [x[1] for x in slots]
  totals = [tl.makespan + branches.lockstep_extra(sched, f, b, s) for s, tl in enumerate(per_stage)]
  worst = int(np.argmax(totals))
  branches.resolve(g, chain, sched, stage=worst)  # leave the graph priced as the step's stage
  info["stages"] = f"stage {worst} of {sched.n_stages} (slowest, lock-step ticks)"
  info["lockstep_idle_s"] = totals[worst] - per_stage[worst].makespan
  return per_stage[worst], totals[worst] - per_stage[worst].makespan, info


def predict_train(cfg: Config, hw: HardwareProfile, backend: str = "auto", captured=None) -> dict:
  t0 = time.perf_counter()
  cap = captured or capture.train_step(cfg)
  t1 = time.perf_counter()
  g = graph_lib.from_hlo_text(cap.hlo_text, cap.n_devices)
  chain = costs.make_chain(hw, backend)
  tl, lockstep, cond_info = _resolve_and_schedule(g, chain, hw, cfg)
  scale = _host_factor(hw, cap.n_devices)
  from perfmodel.calibrate_nodes import pow2_tokens  # noqa: PLC0415
  step = composed(g, chain, hw, cap.n_devices, temp_bytes=cap.memory.get("temp_size_in_bytes", 0.0),
                  pow2=pow2_tokens(cfg))
  composition = step is not None
  if step is None:
    step = (tl.makespan + lockstep) * scale + hw.calibration.get("step_overhead_s", 0.0)
  else:
    scale = step / tl.makespan if tl.makespan else 1.0  # breakdown shares scaled to the composed step
  t2 = time.perf_counter()
  tokens = cfg.data.global_batch * cfg.data.seq_len
  model_flops = flops_lib.train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
  dtype = {"bfloat16": "bf16", "float16": "f16"}.get(cfg.model.dtype, "f32")
  peak_total = hw.peak(dtype) * (1 if hw.name == "cpu" else cap.n_devices)
  tot = g.totals()
  ana = memory.analytic(cfg)
  return {
      "mode": "train", "config": cfg.name, "hardware": hw.name, "calibrated": hw.calibrated,
      "backends": chain.names, "n_devices": cap.n_devices,
      "mesh": {k: v for k, v in cfg.mesh.sizes().items() if v != 1},
      "step_time_s": step, "tokens_per_s": tokens / step, "mfu": model_flops / step / peak_total,
      "peak_memory_bytes": cap.memory["peak_bytes"], "memory_analysis": cap.memory,
      "memory_analytic": ana.to_dict(),
      "flops_per_device": tot["flops"], "xla_cost_analysis_flops": cap.cost_analysis.get("flops"),
      "model_flops_per_step": model_flops, "collective_bytes_per_device": tot["collective_bytes"],
      "node_counts": tot["node_counts"], "breakdown": _breakdown(tl, scale), "host_device_factor": scale,
      "composition": "calibrated (one pinned core, N devices in series)" if composition else "timeline",
      "conditionals": cond_info,
      "compile_s": cap.lower_s + cap.compile_s, "predict_s": t2 - t1, "total_s": t2 - t0,
  }


def predict_infer(cfg: Config, hw: HardwareProfile, batch: int, prompt_len: int, gen_len: int,
                  backend: str = "auto", captured=None) -> dict:
  cap = captured or capture.sampler(cfg, batch, prompt_len, gen_len)
  t0 = time.perf_counter()  # after the compile: predict_s is the prediction alone, as predict_train's
  g = graph_lib.from_hlo_text(cap.hlo_text, 1)
  chain = costs.make_chain(hw, backend)
  from perfmodel import branches  # noqa: PLC0415
  branches.resolve(g, chain)  # the sampler's conditionals (if any): costliest branch
  entry = g.regions[g.entry]
  loops = [n for n in entry.nodes if n.kind == "loop" and n.trip_count == gen_len]
  decode = max(loops, key=lambda n: timeline.schedule(g, chain, n.body, {}).makespan) if loops else None
  # its nodes priced as decode nodes (learned.py: their own neighbours); a loop node itself is not replaced
  graph_lib.mark_decode(g, decode.body if decode else None)
  cache = {}
  full = timeline.schedule(g, chain, None, cache)
  tpot = timeline.schedule(g, chain, decode.body, cache).makespan if decode else 0.0
  overhead = hw.calibration.get("step_overhead_s", 0.0)
  ttft = full.makespan - (tpot * gen_len) + overhead
  total = full.makespan + overhead
  coef = composition_for(hw, chain)
  if coef:
    from perfmodel import calibrate_nodes as cn
    price = lambda n: chain.price(n).seconds  # noqa: E731
    f_all = cn.composition_features(g, price, 1, temp_bytes=cap.memory.get("temp_size_in_bytes", 0.0), hw=hw)
    f_dec = cn.composition_features(g, price, 1, decode.body, hw=hw) if decode else [0.0] * len(f_all)
    f_dec[2] = 0.0
    # prefill + sampling glue: everything outside the decode loop, composed as a single-device step
    f_rest = [a - b * (gen_len if decode else 0) for a, b in zip(f_all, f_dec)]
    tpot = cn.compose(coef, f_dec, "decode") if decode else 0.0
    ttft = cn.compose(coef, f_rest, "train")
    total = ttft + tpot * gen_len
  return {
      "mode": "infer", "config": cfg.name, "hardware": hw.name, "calibrated": hw.calibrated, "backends": chain.names,
      "batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
      "ttft_s": ttft, "tpot_s": tpot, "total_s": total,
      "tokens_per_s": batch * gen_len / total if total else 0.0,
      "decode_tokens_per_s": batch / tpot if tpot else 0.0,
      "peak_memory_bytes": cap.memory["peak_bytes"], "memory_analysis": cap.memory,
      "breakdown": _breakdown(full, 1.0), "compile_s": cap.lower_s + cap.compile_s,
      "predict_s": time.perf_counter() - t0,
  }


def predict_train_analytic(cfg: Config, hw: HardwareProfile, backend: str = "auto") -> dict:
  """No compile: analytic graph (perfmodel.analytic) + pipeline schedule + analytic memory."""
  from perfmodel import analytic, pipeline
  t0 = time.perf_counter()
  mesh = cfg.mesh
  mb = mesh.microbatches if mesh.pipeline > 1 else 1
  g = analytic.build(cfg, microbatch_tokens_div=mb)
  tl, chain = price_graph(g, hw, backend)
  n_dev = g.n_devices
  if mesh.pipeline > 1:
    fwd = tl.by_phase.get("fwd", 0.0)
    bwd = tl.makespan - fwd
    act_bytes = (cfg.data.global_batch // (mesh.data * mesh.fsdp) // mb) * cfg.data.seq_len * cfg.model.d_model * 4
    from perfmodel import collectives
    p2p = collectives.permute(act_bytes, hw.links[0].bandwidth, hw.links[0].latency) if hw.links else 0.0
    pc = pipeline.cost(mesh.schedule, mesh.pipeline, mb, fwd, bwd, c=p2p)
    step, bubble = pc.step_time, pc.bubble_fraction
  else:
    step, bubble = tl.makespan, 0.0
  scale = _host_factor(hw, n_dev)
  step = step * scale + hw.calibration.get("step_overhead_s", 0.0)
  tokens = cfg.data.global_batch * cfg.data.seq_len
  model_flops = flops_lib.train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
  dtype = {"bfloat16": "bf16", "float16": "f16"}.get(cfg.model.dtype, "f32")
  peak_total = hw.peak(dtype) * (1 if hw.name == "cpu" else n_dev)
  mem = memory.analytic(cfg)
  tot = g.totals()
  return {
      "mode": "train", "method": "analytic", "config": cfg.name, "hardware": hw.name, "calibrated": hw.calibrated,
      "backends": chain.names, "n_devices": n_dev, "mesh": {k: v for k, v in mesh.sizes().items() if v != 1},
      "step_time_s": step, "tokens_per_s": tokens / step, "mfu": model_flops / step / peak_total,
      "peak_memory_bytes": mem.total, "memory_analytic": mem.to_dict(), "pipeline_bubble_fraction": bubble,
      "flops_per_device": tot["flops"] * mb, "model_flops_per_step": model_flops,
      "collective_bytes_per_device": tot["collective_bytes"] * mb, "node_counts": tot["node_counts"],
      "breakdown": _breakdown(tl, scale * mb), "fits_in_memory": mem.total <= hw.mem_bytes,
      "predict_s": time.perf_counter() - t0,
  }


def predict_train_rank_program(cfg: Config, hw: HardwareProfile, backend: str = "auto") -> dict:
  """No N-device compile: the rank's real per-device program (perfmodel.emulate.rank_program, the program the
  emulator runs), traced on an AbstractMesh at the target sizes -> jaxpr graph -> costs -> timeline."""
  import math
  import jax
  from perfmodel import jaxpr_graph
  from perfmodel.emulate import rank_program
  t0 = time.perf_counter()
  prog = rank_program.build(cfg)
  local = jax.tree.leaves(prog.local_state.params)
  n_local = sum(math.prod(x.shape) for x in local)
  pbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in local)
  # AdamW on the rank's shards (outside the traced body): read p, g, m, v; write p, m, v.
  opt = dict(name="adamw_update", kind="fusion", opcode="fusion:jaxpr", flops=12.0 * n_local,
             transcendentals=float(n_local), bytes=7.0 * pbytes, out_bytes=3.0 * pbytes,
             attribution=graph_lib.Attribution(op_name="optimizer", phase="opt", op="adamw"))
  g, notes = jaxpr_graph.build(prog.body, cfg.mesh.sizes(), extra_entry_nodes=[opt])
  tl, chain = price_graph(g, hw, backend)
  step = tl.makespan + hw.calibration.get("step_overhead_s", 0.0)
  tokens = cfg.data.global_batch * cfg.data.seq_len
  model_flops = flops_lib.train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
  dtype = {"bfloat16": "bf16", "float16": "f16"}.get(cfg.model.dtype, "f32")
  n_dev = g.n_devices
  mem = memory.analytic(cfg)
  tot = g.totals()
  return {
      "mode": "train", "method": "rank_program", "route": "rank_program",
      "route_detail": "per-device shard_map body traced on an AbstractMesh (perfmodel.emulate.rank_program), "
                      "jaxpr graph (perfmodel.jaxpr_graph); no N-device compile",
      "config": cfg.name, "hardware": hw.name, "calibrated": hw.calibrated, "backends": chain.names,
      "n_devices": n_dev, "mesh": {k: v for k, v in cfg.mesh.sizes().items() if v != 1},
      "step_time_s": step, "tokens_per_s": tokens / step, "mfu": model_flops / step / (hw.peak(dtype) * n_dev),
      "peak_memory_bytes": mem.total, "memory_analytic": mem.to_dict(), "rank_param_bytes": pbytes,
      "flops_per_device": tot["flops"], "model_flops_per_step": model_flops,
      "collective_bytes_per_device": tot["collective_bytes"], "node_counts": tot["node_counts"],
      "breakdown": _breakdown(tl, 1.0), "fits_in_memory": mem.total <= hw.mem_bytes, "notes": notes,
      "trace_s": prog.trace_s, "predict_s": time.perf_counter() - t0,
  }
