"""predict(config, hardware) -> Prediction: step time, tokens/s, MFU, peak memory (training) or TTFT / TPOT (inference).

Top-down, every route goes config -> program -> graph -> costs -> timeline -> Prediction:

  * ``compile`` (training, up to COMPILE_MAX_DEVICES): the real N-device step compiled on virtual devices
    (perfmodel/program.py) -> its HLO graph (perfmodel/graph/from_hlo.py) -> the cost chain
    (perfmodel/cost/chain.py) -> the timeline (perfmodel/timeline.py), pipeline slots resolved from the schedule
    (perfmodel/pipeline.py); on a calibrated host the profile's composition (perfmodel/compose.py) turns the priced
    nodes into the step, and the compiler's own memory_analysis is the peak memory;
  * ``rank_program`` (training, any N): one rank's per-device program traced on an AbstractMesh -> its jaxpr graph
    (perfmodel/graph/from_jaxpr.py) -> costs -> timeline; analytic memory;
  * ``analytic`` (training; the fallback, and what ``search`` ranks with): a graph built from the config alone
    (perfmodel/graph/analytic.py), the pipeline schedule's ticks (perfmodel/pipeline.py), analytic memory;
  * inference: the real KV-cached sampler compiled for one device; everything before the decode loop is the prefill
    (TTFT), one trip of the loop body one decode step (TPOT).

Virtual CPU devices share the host's cores, so on the ``cpu`` profile a program replicated over N virtual devices
takes about N x its per-device time / host_parallelism (calibrated); on real accelerators every device runs its copy
in parallel and the per-device timeline is the step.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Union

import jax

from framework import flops as flops_lib
from framework.config import Config, validate
from parallelism import targets
from parallelism import target_flags
from perfmodel import compose, memory, pipeline, program, target, timeline
from perfmodel.cost import chain as chain_lib
from perfmodel.cost import collectives, profiler
from perfmodel.graph import analytic, from_hlo, from_jaxpr
from perfmodel.graph.nodes import Attribution, ExecGraph, mark_decode
from perfmodel.hardware import HardwareProfile, load as load_profile
from perfmodel.prediction import Prediction

COMPILE_MAX_DEVICES = 512  # above this, `method="auto"` traces the rank's program instead of compiling N devices
# Megatron-Core's overlap options (--overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap), set by its
# published runs, modelled in the timeline (timeline.Overlap): the data-parallel gradient bucket in parameters, and
# where the options and bucket were read
OVERLAP = {
    "megatron": (40_000_000, "github NVIDIA/Megatron-LM README.md @937571cfd4 (its H100 table's runs set the three "
                             "options); bucket: megatron/core/distributed/distributed_data_parallel_config.py "
                             "bucket_size default max(40000000, 1000000 * dp_size) parameters"),
    "nemo": (75 * 2**20 // 4, "github NVIDIA/dgxc-benchmarking @143b90d llama3.1/llama3.1_70b.yaml, _405b.yaml "
                              "(overlap_grad_sync, overlap_param_sync, ub_tp_comm_overlap; bucket_cap_mb 75, fp32)"),
}


def n_devices(cfg: Config) -> int:
  return math.prod(cfg.mesh.sizes().values())


def is_target(hw: HardwareProfile) -> bool:
  """Whether the compiler of ``hw`` is available here as compile-only devices (parallelism/targets.py)."""
  return hw.name in targets.HARDWARE and hw.device_kind != "cpu"


def resolve_method(n: int, mode: str = "train", method: str = "auto", hw: Optional[HardwareProfile] = None) -> str:
  """The route a prediction takes: inference always compiles its one-device sampler; training ``auto`` compiles
  for the target when ``hw`` is a TPU or GPU (``target_compile``), else on host devices up to COMPILE_MAX_DEVICES
  and traces the rank's program (falling back to the analytic graph) above."""
  if mode == "infer":
    return "compile"
  if method == "auto" and hw is not None and is_target(hw):
    return "target_compile"
  if method == "auto":
    return "compile" if n <= COMPILE_MAX_DEVICES else "auto_large"
  return method


def predict(cfg: Config, hardware: Union[str, HardwareProfile], mode: str = "train", method: str = "auto",
            backend: str = "auto", batch: int = 1, prompt_len: int = 32, gen_len: int = 32,
            captured: Optional[program.Captured] = None, topology: Optional[str] = None,
            compile_budget_s: Optional[float] = None, framework: Optional[str] = None,
            trace: bool = False, profile_nodes: bool = False, devices: int = 0) -> Prediction:
  """The one entry point: the whole of a prediction from a config (validated here against ``devices``, default the
  mesh's size): its route, the compile (on virtual host devices or for the target), timing the program's
  instructions when the backend prices from them (or ``profile_nodes``), uneven pipeline stages, the rates.

  ``captured``: the compiled program when the caller has it already (validate caches programs). ``topology``: the
  target's slice / node shape (``parallelism.targets.plan``), for ``target_compile``; ``compile_budget_s``: stop
  that compile after this many seconds once the optimised program exists (perfmodel/target.py; None: compile to the
  end). ``framework``: the training framework the step is priced as: its XLA flags (parallelism/target_flags.py) go
  into the target compile, its overlap options into the timeline. ``trace``: keep the predicted timeline in
  ``Prediction.events``."""
  target_flags.framework_key(framework)  # an unknown name is refused before anything compiles
  hw = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
  real = cfg
  cfg, uneven = even_stages(cfg)
  cfg = validate(cfg, devices or math.prod(abs(v) for v in cfg.mesh.sizes().values()))
  p = _predict(cfg, hw, mode, method, backend, batch, prompt_len, gen_len, captured, topology, compile_budget_s,
               framework, trace, profile_nodes)
  p.profile_s = p.profile_s or 0.0
  if uneven:  # FLOP-based rates of the real layer count
    scale = (flops_lib.train_flops_per_token(real.model, real.data.seq_len)
             / flops_lib.train_flops_per_token(cfg.model, cfg.data.seq_len))
    p.mfu = p.mfu * scale if p.mfu is not None else None
    if p.model_flops_per_step is not None:
      p.model_flops_per_step *= scale
    p.assumptions = (p.assumptions or []) + [uneven]
  return p


def even_stages(cfg: Config):
  """A pipeline whose stages cannot hold equal layer counts (Llama-3.1-405B: 126 layers over 16 stages) runs its
  slowest stage with ceil(L / P) layers, and that stage sets the lock-step pace: priced as P stages of ceil(L / P)
  layers. Returns (config to price, note or None); predict scales FLOP-based rates back to the real L."""
  P, n_layers = cfg.mesh.pipeline, cfg.model.n_layers
  if P <= 1 or n_layers % P == 0:
    return cfg, None
  per = -(-n_layers // P)
  note = (f"model.n_layers={n_layers} over {P} pipeline stages: priced as {P} stages of {per} layers (the slowest "
          f"stage of an uneven split, which sets the step), FLOP rates for {n_layers} layers")
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=per * P)), note


def _profile(cap, hw: HardwareProfile, backend: str, asked: bool) -> dict:
  """Times this program's instructions alone first (into the user's cache) when asked or when the backend prices
  from them (cost/chain.py NEEDS_PROFILED_PROGRAM): 2-20 s the first time a program is seen. Returns the
  Prediction fields it fills."""
  if not (asked or chain_lib.resolve_backend(hw, backend) in chain_lib.NEEDS_PROFILED_PROGRAM):
    return {}
  t0 = time.perf_counter()
  r = profiler.profile_program(cap.hlo_text, cap.n_devices, hw.name, stale_before=profiler.stale_before(hw))
  return {"profiled_nodes": {k: v for k, v in r.items() if k != "seconds"}, "profile_s": time.perf_counter() - t0}


def _predict(cfg: Config, hw: HardwareProfile, mode: str, method: str, backend: str, batch: int, prompt_len: int,
             gen_len: int, captured, topology: Optional[str], compile_budget_s: Optional[float],
             framework: Optional[str], trace: bool, profile_nodes: bool) -> Prediction:
  route = resolve_method(n_devices(cfg), mode, method, hw)
  if mode == "infer":
    return _infer(cfg, hw, batch, prompt_len, gen_len, backend, captured, trace, profile_nodes)
  if route == "target_compile":
    if not is_target(hw):
      raise ValueError(f"--method target_compile needs a TPU or GPU profile ({', '.join(targets.HARDWARE)}), "
                       f"not {hw.name!r}")
    cap = captured or target.train_step(cfg, hw.name, topology, budget_s=compile_budget_s, framework=framework)
    p = _train_compiled(cfg, hw, backend, cap, route, framework, trace)
    fs = target_flags.flag_set(hw.name, framework)
    p.compiler_flags = {"set": fs.name, "source": fs.source, "flags": dict(fs.flags),
                        "not_passed": dict(fs.dropped)} if captured is None else \
        {"set": "as committed with the program", "source": cap.route_detail}
    return p
  if route == "compile":
    return _train_compiled(cfg, hw, backend, captured, framework=framework, trace=trace, profile_nodes=profile_nodes)
  if route == "analytic":
    return _train_analytic(cfg, hw, backend, trace)
  try:
    return _train_rank_program(cfg, hw, backend, trace)
  except Exception as e:  # noqa: BLE001 (auto falls back from any failure of the traced route, and says why)
    if route == "rank_program":
      raise
    p = _train_analytic(cfg, hw, backend, trace)
    p.route_fallback_reason = f"rank_program route failed: {type(e).__name__}: {str(e)[:300]}"
    return p


# ---------------------------------------------------------------- shared pieces

def _base(cfg: Config, hw: HardwareProfile, chain, mode: str = "train") -> Prediction:
  return Prediction(mode=mode, config=cfg.name, hardware=hw.name, calibrated=hw.calibrated, backends=chain.names)


def _train_rates(p: Prediction, cfg: Config, hw: HardwareProfile, devices_sharing_peak: int) -> None:
  tokens = cfg.data.global_batch * cfg.data.seq_len
  dtype = {"bfloat16": "bf16", "float16": "f16"}.get(cfg.model.dtype, "f32")
  p.model_flops_per_step = flops_lib.train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens
  p.tokens_per_s = tokens / p.step_time_s
  p.mfu = p.model_flops_per_step / p.step_time_s / (hw.peak(dtype) * devices_sharing_peak)


def _graph_totals(p: Prediction, g: ExecGraph, times: float = 1.0) -> None:
  tot = g.totals()
  p.flops_per_device = tot["flops"] * times
  p.collective_bytes_per_device = tot["collective_bytes"] * times
  p.node_counts = tot["node_counts"]


def _host_factor(hw: HardwareProfile, n: int) -> float:
  """On the cpu profile N virtual devices share the host: their per-device timelines add up, less what the host
  runs in parallel (calibrated)."""
  if hw.name != "cpu" or n <= 1:
    return 1.0
  return n / max(1.0, min(float(n), hw.calibration.host_parallelism))


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


def _events(tl: timeline.Timeline, scale: float, after: tuple = ()) -> list:
  """The recorded events of ``tl`` with times x ``scale``, then each ``(name, seconds)`` of ``after`` in turn (on
  the wait thread): what the step adds after its program's timeline, so the last event ends at the step."""
  evs = [timeline.Event(e.name, e.cat, e.start * scale, e.dur * scale, dict(e.args)) for e in tl.events]
  t = tl.makespan * scale
  for name, dur in after:
    if dur > 0:
      evs.append(timeline.Event(name, "wait", t, dur))
      t += dur
  return evs


def _mesh(cfg: Config) -> dict:
  return {k: v for k, v in cfg.mesh.sizes().items() if v != 1}


# ---------------------------------------------------------------- routes

def _overlap(cfg: Config, framework: Optional[str], fwd_s: float, bwd_s: float) -> Optional[timeline.Overlap]:
  """The framework's overlap options (OVERLAP, or those its spec names: target_flags.overlap_options) on this
  config's mesh; the windows are one micro-batch's forward and backward compute."""
  key, opts = target_flags.framework_key(framework), target_flags.overlap_options(framework)
  if opts is None:
    opts = target_flags.OVERLAP_OPTIONS if key in OVERLAP else ()
  if not opts:
    return None
  mesh = cfg.mesh
  local = cfg.model.n_params(embeddings=True) / (mesh.tensor * mesh.pipeline)
  bucket = max(OVERLAP.get(key, OVERLAP["megatron"])[0], 1_000_000 * mesh.data * mesh.fsdp if key != "nemo" else 0)
  return timeline.Overlap(tp_comm="tp_comm" in opts, grad_reduce="grad_reduce" in opts,
                          param_gather="param_gather" in opts, sizes=tuple(mesh.sizes().items()), bwd_window_s=bwd_s,
                          fwd_window_s=fwd_s, bucket_fraction=min(1.0, bucket / max(1.0, local)))


def _overlap_info(ov: Optional[timeline.Overlap], framework: Optional[str]) -> Optional[dict]:
  if ov is None:
    return None
  key = target_flags.framework_key(framework)
  src = OVERLAP[key][1] if key in OVERLAP and target_flags.overlap_options(framework) is None else \
      f"the options named by the framework spec {framework!r}; bucket: Megatron-Core's rule ({OVERLAP['megatron'][1]})"
  return {"options": [k for k in ("tp_comm", "grad_reduce", "param_gather") if getattr(ov, k)], "source": src,
          "bwd_window_s": ov.bwd_window_s, "fwd_window_s": ov.fwd_window_s, "bucket_fraction": ov.bucket_fraction}


@dataclasses.dataclass
class StageTimeline:
  """One pipeline stage's priced program (stage None: the program without a pipeline)."""
  stage: Optional[int]
  timeline: timeline.Timeline
  lockstep_idle_s: float  # ticks the stage idles waiting for the busiest stage
  overlap: Optional[dict]

  @property
  def step_s(self) -> float:
    return self.timeline.makespan + self.lockstep_idle_s


def stage_timelines(g: ExecGraph, chain, hw: HardwareProfile, cfg: Config, framework: Optional[str] = None,
                    record: bool = False) -> tuple:
  """([StageTimeline], how conditionals were resolved) of a compiled training step; ``record``: keep the placed
  events of each stage's top level (emulation's traces).

  Pipelined programs decide their slots at run time (perfmodel/pipeline.py). On the ``cpu`` profile the N virtual
  devices run in series on shared cores, so the step is their *summed* work: branches weighted by the stage-average
  schedule, no lock-step idle. On parallel hardware each stage's own program is priced, plus the ticks it idles
  waiting for the busiest stage. A framework's overlap options (:func:`_overlap`) take one micro-batch's forward
  and backward as their windows: the pipeline slot's on a pipelined program, the step's compute over its
  gradient-accumulation steps otherwise."""
  sched = pipeline.schedule_of(cfg)
  if sched is None or hw.name == "cpu":
    info = pipeline.resolve(g, chain, sched, stage=None)
    info["stages"] = "average over stages (N devices in series)" if sched is not None else None
    tl = timeline.schedule(g, chain, record=record)
    ov = _overlap(cfg, framework, tl.by_phase.get("fwd", 0.0) / cfg.mesh.microbatches,
                  tl.by_phase.get("bwd", 0.0) / cfg.mesh.microbatches) if sched is None else None
    tl = timeline.schedule(g, chain, overlap=ov, record=record) if ov else tl
    return [StageTimeline(None, tl, 0.0, _overlap_info(ov, framework))], info
  stages, slots = [], []
  for s in range(sched.n_stages):
    info = pipeline.resolve(g, chain, sched, stage=s)
    slots.append(pipeline.slot_work(g, chain))
    ov = _overlap(cfg, framework, *slots[-1])
    stages.append(StageTimeline(s, timeline.schedule(g, chain, overlap=ov, record=record), 0.0, _overlap_info(ov, framework)))
  f, b = [x[0] for x in slots], [x[1] for x in slots]
  for st in stages:
    st.lockstep_idle_s = pipeline.lockstep_extra(sched, f, b, st.stage)
  return stages, info


def _schedule_train(g: ExecGraph, chain, hw: HardwareProfile, cfg: Config, framework: Optional[str] = None,
                    record: bool = False):
  """(timeline, lock-step idle seconds, how conditionals were resolved, overlap) of the step's slowest stage
  (:func:`stage_timelines`)."""
  stages, info = stage_timelines(g, chain, hw, cfg, framework, record)
  worst = max(stages, key=lambda st: st.step_s)
  if worst.stage is not None:
    pipeline.resolve(g, chain, pipeline.schedule_of(cfg), stage=worst.stage)  # leave the graph priced as it
    info["stages"] = f"stage {worst.stage} of {len(stages)} (slowest, lock-step ticks)"
    info["lockstep_idle_s"] = worst.lockstep_idle_s
  return worst.timeline, worst.lockstep_idle_s, info, worst.overlap


def _train_compiled(cfg: Config, hw: HardwareProfile, backend: str, captured, route: str = "compile",
                    framework: Optional[str] = None, trace: bool = False, profile_nodes: bool = False) -> Prediction:
  t0 = time.perf_counter()
  if captured is None and route == "compile":
    program.ensure_devices(n_devices(cfg))
  cap = captured or program.train_step(cfg)
  profiled = _profile(cap, hw, backend, profile_nodes) if route == "compile" else {}
  t1 = time.perf_counter()
  g = from_hlo.from_hlo_text(cap.hlo_text, cap.n_devices)
  chain = chain_lib.make_chain(hw, backend, framework=framework)
  chain.placement = cap.placement
  tl, lockstep, cond_info, overlap = _schedule_train(g, chain, hw, cfg, framework, record=trace)
  scale = _host_factor(hw, cap.n_devices)
  comp = chain.composition()
  if comp is None:
    step = (tl.makespan + lockstep) * scale + hw.calibration.step_overhead_s
  else:
    feats = compose.step_features(g, lambda n: chain.price(n).seconds, cap.n_devices,
                                  temp_bytes=cap.memory.get("temp_size_in_bytes", 0.0), hw=hw,
                                  pow2=compose.pow2_tokens(cfg))
    step = comp.seconds(feats, compose.program_type(cap.n_devices))
    scale = step / tl.makespan if tl.makespan else 1.0  # breakdown shares scaled to the composed step
  t2 = time.perf_counter()
  p = dataclasses.replace(_base(cfg, hw, chain), **profiled)
  p.route = p.method = route
  p.route_detail = cap.route_detail or None
  p.n_devices, p.mesh, p.step_time_s = cap.n_devices, _mesh(cfg), step
  _train_rates(p, cfg, hw, 1 if hw.name == "cpu" else cap.n_devices)
  p.peak_memory_bytes, p.memory_analysis = cap.memory["peak_bytes"], cap.memory
  if route == "target_compile":
    p.fits_in_memory = (cap.memory.get("needed", cap.memory["peak_bytes"]) <= hw.mem_bytes
                        and "RESOURCE_EXHAUSTED" not in cap.memory.get("compile_error", ""))  # the compiler's word
    p.assumptions = chain.assumptions or None
  p.memory_analytic = memory.analytic(cfg).to_dict()
  _graph_totals(p, g)
  p.xla_cost_analysis_flops = cap.cost_analysis.get("flops")
  p.breakdown, p.host_device_factor = _breakdown(tl, scale), scale
  p.composition = "calibrated (one pinned core, N devices in series)" if comp is not None else "timeline"
  p.conditionals, p.overlap = cond_info, overlap
  p.compile_s, p.predict_s, p.wall_s = cap.lower_s + cap.compile_s, t2 - t1, t2 - t0
  if trace:
    p.events = _events(tl, scale, () if comp is not None else (
        ("lock-step idle (the slowest stage's ticks)", lockstep * scale),
        ("step overhead (calibration)", hw.calibration.step_overhead_s)))
  return p


def _infer(cfg: Config, hw: HardwareProfile, batch: int, prompt_len: int, gen_len: int, backend: str,
           captured, trace: bool = False, profile_nodes: bool = False) -> Prediction:
  if captured is None:
    program.ensure_devices(1)
  cap = captured or program.sampler(cfg, batch, prompt_len, gen_len)
  profiled = _profile(cap, hw, backend, profile_nodes)
  t0 = time.perf_counter()  # after the compile: predict_s is the prediction alone
  g = from_hlo.from_hlo_text(cap.hlo_text, 1)
  chain = chain_lib.make_chain(hw, backend)
  pipeline.resolve(g, chain)  # the sampler's conditionals (if any): costliest branch
  loops = [n for n in g.regions[g.entry].nodes if n.kind == "loop" and n.trip_count == gen_len]
  decode = max(loops, key=lambda n: timeline.schedule(g, chain, n.body, {}).makespan) if loops else None
  mark_decode(g, decode.body if decode else None)  # priced as decode nodes (cost/learned.py); not the loop node
  cache = {}
  full = timeline.schedule(g, chain, None, cache)
  tpot = timeline.schedule(g, chain, decode.body, cache).makespan if decode else 0.0
  overhead = hw.calibration.step_overhead_s
  ttft = full.makespan - (tpot * gen_len) + overhead
  total = full.makespan + overhead
  comp = chain.composition()
  if comp is not None:
    price = lambda n: chain.price(n).seconds  # noqa: E731
    f_all = compose.step_features(g, price, 1, temp_bytes=cap.memory.get("temp_size_in_bytes", 0.0), hw=hw)
    f_dec = compose.step_features(g, price, 1, decode.body, hw=hw, per_step=False) if decode else None
    # prefill + sampling glue: everything outside the decode loop, composed as a single-device step
    f_rest = f_all.minus(f_dec, gen_len) if decode else f_all
    tpot = comp.seconds(f_dec, "decode") if decode else 0.0
    ttft = comp.seconds(f_rest, "train")
    total = ttft + tpot * gen_len
  p = dataclasses.replace(_base(cfg, hw, chain, mode="infer"), **profiled)
  p.batch, p.prompt_len, p.gen_len = batch, prompt_len, gen_len
  p.ttft_s, p.tpot_s, p.generation_s = ttft, tpot, total
  p.tokens_per_s = batch * gen_len / total if total else 0.0
  p.decode_tokens_per_s = batch / tpot if tpot else 0.0
  p.peak_memory_bytes, p.memory_analysis = cap.memory["peak_bytes"], cap.memory
  p.breakdown, p.compile_s = _breakdown(full, 1.0), cap.lower_s + cap.compile_s
  if trace:
    full_tl = timeline.schedule(g, chain, None, {k: v for k, v in cache.items() if k != g.entry}, record=True)
    p.events = (_events(full_tl, total / full.makespan) if comp is not None and full.makespan
                else _events(full_tl, 1.0, (("step overhead (calibration)", overhead),)))
  p.predict_s = time.perf_counter() - t0
  return p


def _train_analytic(cfg: Config, hw: HardwareProfile, backend: str = "auto", trace: bool = False) -> Prediction:
  """No program: the analytic graph, the pipeline schedule's ticks and analytic memory."""
  t0 = time.perf_counter()
  mesh = cfg.mesh
  mb = mesh.microbatches if mesh.pipeline > 1 else 1
  g = analytic.build(cfg, microbatch_tokens_div=mb)
  chain = chain_lib.make_chain(hw, backend)
  tl = timeline.schedule(g, chain, record=trace)
  n_dev = g.n_devices
  if mesh.pipeline > 1:
    fwd = tl.by_phase.get("fwd", 0.0)
    bwd = tl.makespan - fwd
    act_bytes = (cfg.data.global_batch // (mesh.data * mesh.fsdp) // mb) * cfg.data.seq_len * cfg.model.d_model * 4
    p2p = collectives.permute(act_bytes, hw.links[0].bandwidth, hw.links[0].latency) if hw.links else 0.0
    pc = pipeline.cost(mesh.schedule, mesh.pipeline, mb, fwd, bwd, c=p2p, v=mesh.virtual_stages)
    step, bubble = pc.step_time, pc.bubble_fraction
  else:
    step, bubble = tl.makespan, 0.0
  scale = _host_factor(hw, n_dev)
  p = _base(cfg, hw, chain)
  p.route = p.method = "analytic"
  p.n_devices, p.mesh = n_dev, _mesh(cfg)
  p.step_time_s = step * scale + hw.calibration.step_overhead_s
  _train_rates(p, cfg, hw, 1 if hw.name == "cpu" else n_dev)
  mem = memory.analytic(cfg)
  p.peak_memory_bytes, p.memory_analytic, p.pipeline_bubble_fraction = mem.total, mem.to_dict(), bubble
  _graph_totals(p, g, times=mb)
  p.breakdown, p.fits_in_memory = _breakdown(tl, scale * mb), mem.total <= hw.mem_bytes
  if trace:  # the graph is one micro-batch: the schedule's other micro-batches and its bubble follow it
    p.events = _events(tl, scale, (("pipeline: the other micro-batches and the bubble", (step - tl.makespan) * scale),
                                   ("step overhead (calibration)", hw.calibration.step_overhead_s)))
  p.predict_s = time.perf_counter() - t0
  return p


def _train_rank_program(cfg: Config, hw: HardwareProfile, backend: str = "auto", trace: bool = False) -> Prediction:
  """No N-device compile: the rank's real per-device program, traced on an AbstractMesh at the target sizes."""
  t0 = time.perf_counter()
  prog = program.rank_program(cfg)
  local = jax.tree.leaves(prog.local_state.params)
  n_local = sum(math.prod(x.shape) for x in local)
  pbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in local)
  # AdamW on the rank's shards (outside the traced body): read p, g, m, v; write p, m, v.
  opt = dict(name="adamw_update", kind="fusion", opcode="fusion:jaxpr", flops=12.0 * n_local,
             transcendentals=float(n_local), bytes=7.0 * pbytes, out_bytes=3.0 * pbytes,
             attribution=Attribution(op_name="optimizer", phase="opt", op="adamw"))
  g, notes = from_jaxpr.build(prog.body, cfg.mesh.sizes(), extra_entry_nodes=[opt])
  chain = chain_lib.make_chain(hw, backend)
  tl = timeline.schedule(g, chain, record=trace)
  p = _base(cfg, hw, chain)
  p.route = p.method = "rank_program"
  p.route_detail = ("per-device shard_map body traced on an AbstractMesh (perfmodel.program), "
                    "jaxpr graph (perfmodel.graph.from_jaxpr); no N-device compile")
  p.n_devices, p.mesh = g.n_devices, _mesh(cfg)
  p.step_time_s = tl.makespan + hw.calibration.step_overhead_s
  _train_rates(p, cfg, hw, g.n_devices)
  mem = memory.analytic(cfg)
  p.peak_memory_bytes, p.memory_analytic, p.rank_param_bytes = mem.total, mem.to_dict(), pbytes
  _graph_totals(p, g)
  p.breakdown, p.fits_in_memory, p.notes = _breakdown(tl, 1.0), mem.total <= hw.mem_bytes, notes
  p.trace_s, p.predict_s = prog.trace_s, time.perf_counter() - t0
  if trace:
    p.events = _events(tl, 1.0, (("step overhead (calibration)", hw.calibration.step_overhead_s),))
  return p
