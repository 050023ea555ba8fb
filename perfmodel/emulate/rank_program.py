"""One rank's real program at the target scale, without the target's devices.

The ``shard_map`` step (parallelism/shard_map_step.py) is traced on a ``jax.sharding.AbstractMesh`` of
the target sizes (8192 ranks is just a shape), giving the per-device body as a jaxpr at per-rank
shapes with explicit collectives. Nothing is allocated and nothing is compiled for N devices. That
body plus the optimizer update on this rank's shards *is* the rank's step: :func:`rank_step` turns it
into a single-device function with stand-in collectives (perfmodel/emulate/standins.py).

Why not ``build_step(cfg, mesh).lower()`` on N virtual devices: measured on this host, the
shard_map quickstart step compiles for 1024 virtual CPU devices in 11.5 s (594 MB), but at 8192 XLA
refuses ("Multiprocess computations aren't implemented on the CPU backend"); a per-rank trace has
no such limit and costs the same at any N. Where an N-device compile *is* possible (N <= 1024 here),
:mod:`perfmodel.emulate.memory` still uses it for the byte-exact peak memory of the real program.

The composition below mirrors ``shard_map_step.build`` (same rules, manual-mode model, body, param
specs and optimizer) without its ``jax.set_mesh``, which does not accept an AbstractMesh. A pipelined
config (mesh.pipeline > 1) uses ``parallelism.pipeline.loss_and_grads_body`` when that module exists.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.sharding import AbstractMesh, PartitionSpec as P

from framework import model as model_lib
from framework import optim, train_step as ts
from framework.config import Config, ConfigError
from parallelism import rules as rules_lib
from parallelism import shard_map_step as sms
from parallelism import step as step_lib
from perfmodel.emulate import standins
from perfmodel.emulate.topology import RankSpace


@dataclasses.dataclass
class RankProgram:
  cfg: Config
  space: RankSpace
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


def _call_compat(fn):
  """Calls ``fn`` with as many trailing positional arguments as its signature takes: the shard_map step
  helpers gained arguments while both were being written (manual_axes, batch_axes)."""
  import inspect  # noqa: PLC0415
  n = len(inspect.signature(fn).parameters)
  return lambda *a: fn(*a[:n])


def abstract_mesh(sizes: dict) -> AbstractMesh:
  return AbstractMesh(tuple(sizes.values()), tuple(sizes.keys()))


def build(cfg: Config) -> RankProgram:
  """Traces the per-device body of ``cfg``'s shard_map step at ``cfg.mesh`` (a validated config)."""
  import time
  t0 = time.perf_counter()
  sizes = cfg.mesh.sizes()
  space = RankSpace.of(sizes)
  amesh = abstract_mesh(sizes)
  rules = rules_lib.get(cfg.mesh.rules)
  if cfg.mesh.pipeline == 1:
    rules = rules_lib.without(rules, sms.PIPELINE_AXIS)
  model = model_lib.build(cfg.model)
  manual = model_lib.build(cfg.model, sms.manual_ctx(amesh, rules))
  tx = optim.make(cfg.optim, cfg.train.steps)
  with nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(functools.partial(ts.init_state, model=model, tx=tx), jax.random.key(0))
  param_specs = nn.logical_to_mesh(nn.get_partition_spec(boxed.params), rules)
  manual_axes = frozenset(amesh.axis_names)
  strip = _call_compat(sms.strip_trivial)
  param_specs = jax.tree.map(lambda s: strip(s if isinstance(s, P) else P(), amesh, manual_axes), param_specs,
                             is_leaf=lambda x: isinstance(x, P) or x is None)
  n_tokens = cfg.data.global_batch * cfg.data.seq_len
  pipelined = cfg.mesh.pipeline > 1
  if pipelined:
    try:
      from parallelism import pipeline  # noqa: PLC0415
    except ImportError as e:
      raise ConfigError("mesh.pipeline > 1 needs parallelism/pipeline.py (the shard_map pipeline), which is not "
                        "in this checkout yet") from e
    body = _call_compat(pipeline.loss_and_grads_body)(cfg, manual, param_specs, n_tokens,
                                                      sms.active(sms.BATCH_AXES, amesh))
  else:
    body = functools.partial(sms._loss_and_grads_body, model=manual, specs=param_specs,  # noqa: SLF001
                             n_tokens=n_tokens, batch_axes=sms.active(sms.BATCH_AXES, amesh))
  batch_spec = strip(step_lib.BATCH_SPEC, amesh, manual_axes)
  fn = jax.shard_map(body, mesh=amesh, in_specs=(param_specs, batch_spec, batch_spec),
                     out_specs=(P(), param_specs), check_vma=True)
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
      raise RuntimeError("a shard_map operand is computed outside it: the emulator expects the step's shard_map to "
                         "take (params, inputs, targets) and closed-over constants only")
  arg_vars = [iv for iv, (k, _) in zip(inner.invars, sources) if k == "arg"]
  const_vars = [iv for iv, (k, _) in zip(inner.invars, sources) if k == "const"]
  order = sorted(((src[1], iv) for iv, src in zip(inner.invars, sources) if src[0] == "arg"), key=lambda t: t[0])
  inner = inner.replace(invars=[iv for _, iv in order], constvars=list(inner.constvars) + const_vars)
  body_closed = jcore.ClosedJaxpr(inner, [src[1] for src in sources if src[0] == "const"])
  del arg_vars
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
  return RankProgram(cfg=cfg, space=space, body=body_closed, param_specs=param_specs,
                     params_treedef=jax.tree.structure(lparams), local_state=lstate, local_batch=(ltok, ltok),
                     tx=tx, trace_s=time.perf_counter() - t0, pipelined=pipelined)


def rank_step(prog: RankProgram, rank: int):
  """(step_fn, interpreter): ``step_fn(state, inputs, targets) -> (state, loss)`` is rank ``rank``'s whole
  training step on one device (forward, backward, gradient reduction stand-ins, AdamW on its shards)."""
  fn, interp = standins.standin_program(prog.body, prog.space, rank)

  def step(state, inputs, targets):
    outs = fn(*jax.tree.leaves(state.params), inputs, targets)
    loss, grads = outs[0], jax.tree.unflatten(prog.params_treedef, outs[1:])
    return ts.apply_grads(state, grads, prog.tx), loss

  return step, interp


def random_state(prog: RankProgram, seed: int = 0):
  """Real arrays at per-rank shapes: parameters ~ N(0, init_std), optimizer moments zero, step 0."""
  leaves, tdef = jax.tree.flatten(prog.local_state.params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  std = prog.cfg.model.init_std
  params = jax.tree.unflatten(tdef, [
      (jax.random.normal(k, x.shape, jnp.float32) * std).astype(x.dtype) for k, x in zip(keys, leaves)])
  opt = prog.tx.init(params)
  return ts.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt)


def random_batch(prog: RankProgram, seed: int = 1):
  shape = prog.local_batch[0].shape
  k1, k2 = jax.random.split(jax.random.key(seed))
  v = prog.cfg.model.vocab_size
  return (jax.random.randint(k1, shape, 0, v, jnp.int32), jax.random.randint(k2, shape, 0, v, jnp.int32))
