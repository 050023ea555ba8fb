"""The train step written per device with explicit collectives (``jax.shard_map``).

Same contract as the ``jit`` form (:class:`parallelism.compiled.CompiledStep`, same ``TrainState``, same
shardings, same donation), so training, ``.lower()``, ``.abstract_state()``, checkpoints and the
performance model do not care which form built the step. What differs is *who* writes the
communication: here every collective is in our code, visible in the jaxpr:

* **DP** (``data``; also ``fsdp`` and ``sequence`` for parameters replicated over them): each device
  differentiates its local loss w.r.t. a device-local (``pcast``-to-varying) copy of the
  parameters, then the gradients are ``psum``-ed over exactly the batch axes the parameter is
  replicated on (:func:`parallelism.manual.reduce_grads`).
* **FSDP / ZeRO-3** (``fsdp``, or ``data``+``fsdp`` with the ``zero3`` preset): the manual-mode model
  ``all_gather``-s a weight right before use; autodiff transposes that into the ``psum_scatter`` of
  its gradient, so gradients come out sharded like the parameters.
* **Megatron TP** (``tensor``): column/row-parallel matmuls, ``psum`` after the row-parallel ones
  (framework/model.py), and a vocab-parallel cross-entropy (``pmax``/``psum`` over ``tensor``) when
  the LM head is vocab-sharded, so full-vocab logits never exist on one device.
* **Megatron SP** (``mesh.tensor_sequence_parallel``): the residual stream between the matmuls holds a
  ``1/tensor`` chunk of the sequence; the column-parallel inputs are ``all_gather``-ed along it over ``tensor``
  and the row-parallel outputs ``psum_scatter``-ed back onto it (framework/model.py).
* **SP / CP** (``sequence``): each device holds a slice of the sequence; attention ``all_gather``-s K/V
  (and their positions) along ``sequence``, or with ``model.attention='ring'`` passes K/V blocks around the
  ``sequence`` ring over zig-zag chunks (framework/attention.py ``ring``, parallelism/manual.py ``sequence_layout``).
* **PP** (``pipeline`` > 1): parallelism/pipeline.py (GPipe / 1F1B, interleaved or circular, over ``ppermute``). The jit form
  with ``pipeline > 1`` is built here too: a shard_map manual over 'pipeline' only.

``mesh.microbatches`` are the pipeline's micro-batches with ``pipeline > 1``; without a pipeline they are
gradient accumulation steps (``framework.train_step.accumulate`` inside the shard_map, over each device's rows:
gradients are summed locally and reduced over the data-parallel axes once per step, as Megatron / DDP do). Mesh axes of size 1 are dropped from the shard_map specs (``manual.strip_trivial``),
so the jaxpr holds only collectives that move data.

Structure: the ``shard_map`` computes (loss, grads) with grads sharded like the params; the optax
update runs outside it under the same ``jax.jit`` (element-wise AdamW plus one global-norm
reduction, which GSPMD partitions without help), with in/out shardings and state donation. With
ZeRO-1 (``optim.shard_optimizer_state``) the gradients leave the shard_map reduce-scattered onto the
optimizer state's shards and a second shard_map runs the update there and all-gathers the parameters
(parallelism/zero.py).

Loss normalisation: every device divides its *sum* of token losses by the *global* token count
and the partial losses are ``psum``-ed, so the loss (and hence every gradient) equals the
single-device mean exactly up to float reassociation.

The per-device helpers (vma typing, gradient reduction, positions, vocab-parallel cross-entropy) are in
parallelism/manual.py.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

from framework import model as model_lib
from framework import moe as moe_lib
from framework import optim, train_step as ts
from framework.config import Config, ConfigError
from parallelism import compiled
from parallelism import pipeline
from parallelism import rules as rules_lib
from parallelism import zero
from parallelism.manual import (BATCH_AXES, PIPELINE_AXIS, active, localize_params, manual_ctx, reduce_grads,
                                sequence_layout, strip_trivial, token_loss_sum)


def _loss_and_grads_body(params, inputs_BxT, targets_BxT, *, model, specs, n_tokens: int, n_seqs: int,
                         batch_axes: tuple, reduce=reduce_grads, accum: int = 1, accum_dtype=None):
  """Per-device (loss, grads) for the non-pipelined layouts. Runs inside shard_map.

  ``accum`` > 1: gradient accumulation over this device's rows in ``accum`` micro-batches, summed locally (in
  ``accum_dtype``, float32 under master weights, as Megatron's main_grad buffer) and reduced over the
  data-parallel axes once, after the last one: one all-reduce / reduce-scatter per step, not per micro-batch."""
  local = localize_params(params, specs, batch_axes)
  # the whole local batch's layout at once: the micro-batch loop holds no collective of its own
  inputs_BxT, targets_BxT, pos_BxT = sequence_layout(model, inputs_BxT, targets_BxT)
  extra = model_lib.fp8_cache(model.cfg, local)  # once per step, before the micro-batch loop

  def loss_and_grads(p, batch):
    def local_loss(q):
      logits, load, aux = moe_apply(model, q, batch["inputs"], batch["pos"], n_seqs, extra)
      return token_loss_sum(model, logits, batch["targets"]) / n_tokens + aux, load

    (loss, load), grads = jax.value_and_grad(local_loss, has_aux=True)(p)
    return loss, grads if accum_dtype is None else jax.tree.map(lambda g: g.astype(accum_dtype), grads), load

  # each micro-batch's loss is normalised by the whole batch's tokens, so the sum is the mean
  batch = {"inputs": inputs_BxT, "targets": targets_BxT, "pos": pos_BxT}
  loss, grads, load = ts.accumulate(loss_and_grads, local, batch, accum, mean=False)
  loss = jax.lax.psum(loss, batch_axes) if batch_axes else loss
  if load is not None and batch_axes:
    load = jax.lax.psum(load, batch_axes)
  return loss, reduce(grads, specs, batch_axes), load


def moe_apply(model, params, inputs_BxT, pos_BxT, n_seqs: int, extra=None):
  """(logits, this device's assignments per layer and expert or None, its share of the balance term).

  The balance term is normalised by the whole batch's ``n_seqs`` sequences, so the per-device shares sum (over
  the batch axes) to the one-device value; under sequence parallelism every rank of a sequence computes the
  sequence's whole term (its statistics are summed over the axis) and adds ``1/sequence`` of it. ``extra``: model
  variables beside the parameters (the step's fp8 weights)."""
  variables = {"params": params, **(extra or {})}
  if not model.cfg.moe:
    return model.apply(variables, inputs_BxT, pos_BxT), None, 0.0
  c = model.cfg
  logits, moe_vars = model.apply(variables, inputs_BxT, pos_BxT, mutable=["moe"])
  seq_shards = model.ctx.size((model.ctx.sequence_axis,)) if model.ctx.sequence_axis else 1
  aux = moe_lib.aux_loss(moe_vars["moe"], c.aux_loss_coef, c.n_layers, n_seqs * seq_shards)
  return logits, moe_lib.layer_load(moe_vars["moe"], c.n_experts), aux


def check(cfg: Config, mesh: Mesh):
  m = cfg.mesh
  if m.pipeline > 1 and not cfg.model.scan_layers:
    raise ConfigError("mesh.pipeline > 1 shards the scanned layer stack: set --config.model.scan_layers=True")
  others = [a for a in mesh.axis_names if a != PIPELINE_AXIS and getattr(m, a) > 1]
  if m.form == "jit" and m.pipeline > 1 and len(others) > 1:
    # XLA 0.10's SPMD partitioner aborts the process (spmd_partitioner_util.cc 'Check failed:
    # partition_group_list...') on a shard_map manual over 'pipeline' with two or more auto axes
    # of size > 1 (seen with data x tensor, data x fsdp, fsdp x sequence); refuse before compiling.
    raise ConfigError(f"mesh.form='jit' with pipeline > 1 supports one other axis of size > 1, got {others}: "
                      f"set --config.mesh.form=shard_map (explicit collectives, any combination)")
  if dict(mesh.shape) != {a: getattr(m, a) for a in mesh.axis_names}:
    raise ConfigError(f"mesh {dict(mesh.shape)} does not match cfg.mesh {m.sizes()}: build it with "
                      f"parallelism.mesh.make_mesh(cfg.mesh)")


def build(cfg: Config, mesh: Mesh, donate: bool = True) -> compiled.CompiledStep:
  """Explicit-collective step: shard_map form, and the pipelined jit form (see below).

  * ``form='shard_map'``: one shard_map manual over every mesh axis; the model runs in manual mode.
  * ``form='jit'`` with ``pipeline > 1``: a shard_map manual over 'pipeline' only
    (``axis_names={'pipeline'}``) runs the same pipeline schedule with an auto-mode model of
    ``n_layers / pipeline`` layers, and GSPMD partitions data / fsdp / tensor / sequence inside it.
  """
  check(cfg, mesh)
  all_manual = cfg.mesh.form == "shard_map"
  pipelined = cfg.mesh.pipeline > 1
  if not (all_manual or pipelined):
    raise ConfigError("shard_map_step.build is for form='shard_map' or pipeline > 1; use parallelism.step.build_step")
  rules = rules_lib.get(cfg.mesh.rules)
  if not pipelined:
    # 'layers' -> 'pipeline' is a no-op at size 1; dropping it keeps shardings identical to the jit form.
    rules = rules_lib.without(rules, PIPELINE_AXIS)
  # auto mode, full shapes: init / eval / sampling; the stack in virtual-stage chunks when pipelined
  model = model_lib.build(cfg.model, model_lib.ParallelCtx(layer_repeats=pipeline.layer_repeats(cfg)))
  tx = optim.make(cfg.optim, cfg.train.steps)
  zero1 = cfg.optim.shard_optimizer_state
  # ZeRO-1 written out (all axes manual): gradients leave the shard_map reduce-scattered onto the optimizer
  # state's shards (padded where parallelism/zero.py pads), and zero.sharded_update runs the optimizer there.
  # The jit form's pipeline leaves the data axes to GSPMD: its gradients are constrained to those shardings
  # instead (as in parallelism/jit_step.py).
  explicit_zero1 = zero1 and all_manual
  ztx = compiled.zero_tx(model, tx, mesh, rules) if zero1 else tx  # the state's optimizer (padded shapes)
  state_sh = compiled.state_shardings(model, ztx, mesh, rules, zero1)
  grad_sh = compiled.grad_shardings(model, state_sh, mesh, zero1, pad=explicit_zero1)
  n_tokens = cfg.data.global_batch * cfg.data.seq_len
  accum = 1 if pipelined else cfg.mesh.microbatches
  if all_manual:
    manual_axes = frozenset(mesh.axis_names)
    inner = model_lib.build(cfg.model, manual_ctx(mesh, rules, pipeline.layer_repeats(cfg),
                                                  cfg.mesh.tensor_sequence_parallel))
    batch_axes = active(BATCH_AXES, mesh)
  else:
    # Manual over 'pipeline' only; the stage model is an ordinary auto-mode model of L/P layers.
    manual_axes = frozenset({PIPELINE_AXIS})
    inner = model_lib.build(dataclasses.replace(cfg.model, n_layers=cfg.model.n_layers // cfg.mesh.pipeline),
                            model_lib.ParallelCtx(layer_repeats=pipeline.layer_repeats(cfg)))
    batch_axes = ()
  # shard_map specs: the same logical rules restricted to the manual axes, minus size-1 axes.
  strip = lambda tree: jax.tree.map(lambda s: strip_trivial(s.spec, mesh, manual_axes), tree)  # noqa: E731
  param_specs = strip(state_sh.params)
  batch_spec = strip_trivial(compiled.BATCH_SPEC, mesh, manual_axes)
  grad_specs = strip(grad_sh) if explicit_zero1 else param_specs
  reduce = functools.partial(reduce_grads, grad_specs=grad_specs, dtype=jnp.float32 if cfg.optim.master_weights
                             else None)

  if pipelined:
    body = pipeline.loss_and_grads_body(cfg, inner, param_specs, n_tokens, batch_axes, masked=not all_manual,
                                        reduce=reduce)
  else:
    body = functools.partial(_loss_and_grads_body, model=inner, specs=param_specs, n_tokens=n_tokens,
                             n_seqs=cfg.data.global_batch, batch_axes=batch_axes, reduce=reduce, accum=accum,
                             accum_dtype=jnp.float32 if cfg.optim.master_weights and accum > 1 else None)
  # (loss, grads, assignments per layer and expert): the last only with experts (StepMetrics.expert_load)
  moe = cfg.model.moe
  full = shard_map(body if moe else (lambda *a: body(*a)[:2]), mesh=mesh,
                   in_specs=(param_specs, batch_spec, batch_spec),
                   out_specs=(P(), grad_specs) + ((P(),) if moe else ()), axis_names=manual_axes, check_vma=True)

  def loss_and_grads(params, inputs_BxT, targets_BxT):
    return full(params, inputs_BxT, targets_BxT)[:2]
  update = None
  if explicit_zero1:
    update = zero.sharded_update(tx, mesh, param_specs, grad_specs, strip(state_sh.opt_state))

  def step(state: ts.TrainState, batch):
    params = optim.grad_params(state.params, state.opt_state, cfg.model.dtype)
    loss, grads, *load = full(params, batch["inputs"], batch["targets"])  # micro-batches inside (see the body)
    if update is not None:
      new_params, opt_state, norm = update(state.params, state.opt_state, grads)
      new_state = ts.TrainState(step=state.step + 1, params=new_params, opt_state=opt_state)
    else:
      if zero1:
        grads = jax.lax.with_sharding_constraint(grads, grad_sh)
      norm, new_state = optax.tree.norm(grads), ts.apply_grads(state, grads, ztx)
    load = load[0] if load else None
    new_state = ts.balance_router(new_state, load, cfg.model.router_bias_rate)
    return new_state, ts.StepMetrics(loss=loss, grad_norm=norm, n_tokens=jnp.asarray(n_tokens, jnp.int32),
                                     expert_load=load)

  return compiled.assemble(cfg, mesh, model, ztx, rules, state_sh, step, loss_and_grads, donate)
