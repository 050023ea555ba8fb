"""Config -> the per-device program that really runs, without allocating: the input of every route of predict.

* :func:`train_step` compiles ``parallelism.step.build_step(cfg, mesh)`` (the step ``python -m experiments.run``
  runs) on abstract inputs for the host's (virtual) devices; :func:`sampler` compiles the KV-cached sampler
  ``framework.sampling.generate`` (the code before its decode loop is the prefill, the loop body one decode step).
  Virtual CPU devices must exist before jax starts its backend: :func:`ensure_devices`.
* :func:`rank_program` traces one rank's per-device body of the ``shard_map`` step on an ``AbstractMesh`` of the
  target sizes: the rank's real program at any scale, nothing compiled for N devices (XLA:CPU refuses 8192 virtual
  devices; a trace costs the same at any N). It mirrors ``parallelism.shard_map_step.build`` (same rules,
  manual-mode model, body, parameter specs and optimizer) without its ``jax.set_mesh``, which does not accept an
  AbstractMesh; a pipelined config uses ``parallelism.pipeline.loss_and_grads_body``. The emulator runs the same
  program on one device (perfmodel/emulate/).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.sharding import AbstractMesh, PartitionSpec as P

from framework import model as model_lib
from framework import optim, train_step as ts, xla_flags
from framework import sampling
from framework.config import Config, ConfigError
from parallelism import mesh as mesh_lib
from parallelism import pipeline as pp_lib
from parallelism import rules as rules_lib
from parallelism import shard_map_step as sms
from parallelism import step as step_lib
from parallelism import targets
from perfmodel.cost import collectives


def ensure_devices(n: int) -> None:
  """Asks XLA for at least ``n`` host devices (call before jax starts its backend; a larger count set on purpose
  is kept)."""
  if (xla_flags.host_device_count() or 0) < n:
    xla_flags.set_host_device_count(n)


def _devices(n: int):
  devs = jax.devices()
  if len(devs) < n:
    raise RuntimeError(
        f"the layout needs {n} devices but jax has {len(devs)}: run in a fresh process with "
        f"XLA_FLAGS={xla_flags.FLAG}={n} (the perfmodel CLI does this itself)")
  return devs[:n]


@dataclasses.dataclass
class Captured:
  hlo_text: str
  memory: dict  # memory_analysis fields (per device)
  cost_analysis: dict  # XLA's own (loop bodies counted once)
  n_devices: int
  lower_s: float
  compile_s: float
  jaxpr_eqns: int = 0
  compiled: object = None  # the jax Compiled object (runnable on the host when small)
  placement: Any = None  # collectives.Placement of a target compile (None: host devices)
  route_detail: str = ""  # how the program was obtained when it is not the config's own (perfmodel/target.py)


def memory_of(compiled) -> dict:
  """Per-device memory of a compiled program, with the peak as argument + output - alias + temp."""
  m = compiled.memory_analysis()
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
          "generated_code_size_in_bytes")
  out = {k: int(getattr(m, k, 0) or 0) for k in keys}
  # CPU's own 'peak' ignores temp; argument + output - alias + temp is the live set at the peak.
  out["peak_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"] - out["alias_size_in_bytes"]
                       + out["temp_size_in_bytes"])
  return out


def _cost(compiled) -> dict:
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  return {k: float(v) for k, v in (ca or {}).items() if k in ("flops", "bytes accessed", "transcendentals")}


def mesh_for(cfg: Config):
  n = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor * cfg.mesh.sequence * cfg.mesh.pipeline
  return mesh_lib.make_mesh(cfg.mesh, _devices(n))


def train_step(cfg: Config, keep_compiled: bool = False) -> Captured:
  """Compiles the training step of a validated config (mesh resolved) for its mesh."""
  mesh = mesh_for(cfg)
  step = step_lib.build_step(cfg, mesh)
  t0 = time.perf_counter()
  lowered = step.lower()
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return Captured(hlo_text=compiled.as_text(), memory=memory_of(compiled), cost_analysis=_cost(compiled),
                  n_devices=mesh.size, lower_s=t1 - t0, compile_s=t2 - t1,
                  compiled=(compiled, step) if keep_compiled else None)


def target_train_step(cfg: Config, hardware: str, topology=None, keep_compiled: bool = False,
                      compiler_options: Optional[dict] = None) -> Captured:
  """Compiles the training step for the *target*: ``parallelism.step.build_step`` on a mesh of compile-only TPU or
  GPU devices (``parallelism.targets.target_mesh``), traced under that mesh so platform-dependent choices (the
  attention kernel, cuDNN) see the target's platform. Memory is the target compiler's
  (``targets.compiled_memory``: ``peak_bytes`` = its ``peak``); ``placement`` locates every partition for the
  collective model. ``compiler_options``: XLA flags for this compile (parallelism/target_flags.py)."""
  mesh = targets.target_mesh(cfg.mesh, hardware, topology)
  with targets.trace_context(hardware):
    step = step_lib.build_step(cfg, mesh)
    t0 = time.perf_counter()
    lowered = step.lower()
  t1 = time.perf_counter()
  compiled = lowered.compile(compiler_options or None)
  t2 = time.perf_counter()
  mem = targets.compiled_memory(compiled)
  memory = dict(mem, peak_bytes=mem["peak"], temp_size_in_bytes=mem["temp"])
  return Captured(hlo_text=compiled.as_text(), memory=memory, cost_analysis=_cost(compiled), n_devices=mesh.size,
                  lower_s=t1 - t0, compile_s=t2 - t1, compiled=(compiled, step) if keep_compiled else None,
                  placement=placement(mesh, hardware, topology))


def placement(mesh, hardware: str, topology=None) -> collectives.Placement:
  """Partition id -> (slice or node, torus coordinates or index in the node) of a target mesh's devices (the
  partition ids of a compiled SPMD program follow ``mesh.devices.flat``)."""
  devs = list(mesh.devices.flat)
  plan = targets.plan(hardware, len(devs), topology)
  if not plan.is_tpu:
    return collectives.Placement(tuple((d.process_index, d.id % targets.GPUS_PER_NODE) for d in devs))
  shape = tuple(int(x) for x in plan.topology.split("x"))
  coords = tuple((getattr(d, "slice_index", 0) or 0, *tuple(d.coords)[:len(shape)]) for d in devs)
  return collectives.Placement(coords, shape, targets.wraparound(hardware, shape))


def sampler(cfg: Config, batch: int, prompt_len: int, gen_len: int, keep_compiled: bool = False) -> Captured:
  """Compiles framework.sampling.generate for (batch, prompt_len, gen_len) on one device."""
  model = model_lib.build(cfg.model)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        nn.unbox(model_lib.abstract_params(model)))
  prompt = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  t0 = time.perf_counter()
  lowered = sampling.generate.lower(params, prompt, rng, model=model, max_new=gen_len, temperature=0.0)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return Captured(hlo_text=compiled.as_text(), memory=memory_of(compiled), cost_analysis=_cost(compiled),
                  n_devices=1, lower_s=t1 - t0, compile_s=t2 - t1,
                  compiled=(compiled, model) if keep_compiled else None)


@dataclasses.dataclass
class RankProgram:
  """One rank's training step at the target mesh: the per-device body as a jaxpr, and its state at per-rank
  shapes (nothing allocated)."""
  cfg: Config
  body: jcore.ClosedJaxpr  # per-device (params..., inputs, targets) -> (loss, grads...)
  param_specs: Any  # params pytree of PartitionSpec (mesh axes)
  params_treedef: Any
  local_state: Any  # TrainState of ShapeDtypeStruct at per-rank shapes
  local_batch: tuple  # (inputs, targets) ShapeDtypeStruct at per-rank shapes
  tx: Any
  trace_s: float
  pipelined: bool

  @property
  def n_params_local(self) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(self.local_state.params))


def local_shape(shape, spec: P, sizes: dict) -> tuple:
  out = list(shape)
  for d, entry in enumerate(spec):
    if entry is None:
      continue
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    k = math.prod(sizes.get(a, 1) for a in axes)
    if out[d] % k:
      raise ConfigError(f"dimension {d} of a parameter of shape {tuple(shape)} ({out[d]}) is not divisible by "
                        f"mesh axes {axes} = {k}: pick mesh sizes that divide the model dims")
    out[d] //= k
  return tuple(out)


def abstract_mesh(sizes: dict) -> AbstractMesh:
  return AbstractMesh(tuple(sizes.values()), tuple(sizes.keys()))


def rank_program(cfg: Config) -> RankProgram:
  """Traces the per-device body of ``cfg``'s shard_map step at ``cfg.mesh`` (a validated config)."""
  t0 = time.perf_counter()
  sizes = cfg.mesh.sizes()
  amesh = abstract_mesh(sizes)
  rules = rules_lib.get(cfg.mesh.rules)
  if cfg.mesh.pipeline == 1:
    rules = rules_lib.without(rules, sms.PIPELINE_AXIS)
  repeats = pp_lib.layer_repeats(cfg)
  model = model_lib.build(cfg.model, model_lib.ParallelCtx(layer_repeats=repeats))
  manual = model_lib.build(cfg.model, sms.manual_ctx(amesh, rules, repeats, cfg.mesh.tensor_sequence_parallel))
  tx = optim.make(cfg.optim, cfg.train.steps)
  with nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(functools.partial(ts.init_state, model=model, tx=tx), jax.random.key(0))
  param_specs = nn.logical_to_mesh(nn.get_partition_spec(boxed.params), rules)
  manual_axes = frozenset(amesh.axis_names)
  param_specs = jax.tree.map(lambda s: sms.strip_trivial(s if isinstance(s, P) else P(), amesh, manual_axes), param_specs,
                             is_leaf=lambda x: isinstance(x, P) or x is None)
  n_tokens = cfg.data.global_batch * cfg.data.seq_len
  pipelined = cfg.mesh.pipeline > 1
  if pipelined:
    body = pp_lib.loss_and_grads_body(cfg, manual, param_specs, n_tokens, sms.active(sms.BATCH_AXES, amesh))
  else:
    body = functools.partial(sms._loss_and_grads_body, model=manual, specs=param_specs,  # noqa: SLF001
                             n_tokens=n_tokens, n_seqs=cfg.data.global_batch,
                             batch_axes=sms.active(sms.BATCH_AXES, amesh))
  batch_spec = sms.strip_trivial(step_lib.BATCH_SPEC, amesh, manual_axes)
  moe = cfg.model.moe  # the body's third output: assignments per layer and expert (None without experts)
  fn = jax.shard_map(body if moe else (lambda *a: body(*a)[:2]), mesh=amesh,
                     in_specs=(param_specs, batch_spec, batch_spec),
                     out_specs=(P(), param_specs) + ((P(),) if moe else ()), check_vma=True)
  gparams = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nn.unbox(boxed.params))
  gtok = jax.ShapeDtypeStruct((cfg.data.global_batch, cfg.data.seq_len), jnp.int32)
  outer = jax.make_jaxpr(fn)(gparams, gtok, gtok)
  eqns = [e for e in outer.jaxpr.eqns if e.primitive.name == "shard_map"]
  if len(eqns) != 1:
    raise RuntimeError(f"expected one shard_map in the traced step, found {len(eqns)}")
  inner = eqns[0].params["jaxpr"]
  # Arrays the body closes over (e.g. the pipeline's schedule tables) reach the shard_map as extra
  # operands from the outer jaxpr's constants: bind them here so the body takes (params, inputs, targets).
  outer_in = {v: i for i, v in enumerate(outer.jaxpr.invars)}
  outer_const = dict(zip(outer.jaxpr.constvars, outer.consts))
  sources = []
  for v in eqns[0].invars:
    if isinstance(v, jcore.Literal):
      sources.append(("const", v.val))
    elif v in outer_in:
      sources.append(("arg", outer_in[v]))
    elif v in outer_const:
      sources.append(("const", outer_const[v]))
    else:
      raise RuntimeError("a shard_map operand is computed outside it: a rank program is the step's shard_map taking "
                         "(params, inputs, targets) and closed-over constants only")
  const_vars = [iv for iv, (k, _) in zip(inner.invars, sources) if k == "const"]
  order = sorted(((src[1], iv) for iv, src in zip(inner.invars, sources) if src[0] == "arg"), key=lambda t: t[0])
  inner = inner.replace(invars=[iv for _, iv in order], constvars=list(inner.constvars) + const_vars)
  body_closed = jcore.ClosedJaxpr(inner, [src[1] for src in sources if src[0] == "const"])
  # Per-rank state: params at local shapes, optimizer state initialised from them (AdamW moments are
  # elementwise, so they shard exactly like the params; GSPMD gives the real step the same layout).
  lparams = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(local_shape(x.shape, s, sizes), x.dtype), gparams,
                         param_specs)
  lopt = jax.eval_shape(tx.init, lparams)
  lstate = ts.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=lparams, opt_state=lopt)
  tok_local = local_shape(gtok.shape, batch_spec, sizes)
  ltok = jax.ShapeDtypeStruct(tok_local, jnp.int32)
  for v, want in zip(inner.invars, jax.tree.leaves(lparams) + [ltok, ltok]):
    if tuple(v.aval.shape) != tuple(want.shape):
      raise AssertionError(f"per-device body input {v.aval.shape} != local shape {want.shape}")
  return RankProgram(cfg=cfg, body=body_closed, param_specs=param_specs,
                     params_treedef=jax.tree.structure(lparams), local_state=lstate, local_batch=(ltok, ltok),
                     tx=tx, trace_s=time.perf_counter() - t0, pipelined=pipelined)
