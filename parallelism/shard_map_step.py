"""The train step written per device with explicit collectives (``jax.shard_map``).

Same contract as the ``jit`` form (:class:`parallelism.step.CompiledStep`, same ``TrainState``, same
shardings, same donation), so training, ``.lower()``, ``.abstract_state()``, checkpoints and the
performance model do not care which form built the step. What differs is *who* writes the
communication: here every collective is in our code, visible in the jaxpr:

* **DP** (``data``; also ``fsdp`` and ``sequence`` for parameters replicated over them): each device
  differentiates its local loss w.r.t. a device-local (``pcast``-to-varying) copy of the
  parameters, then the gradients are ``psum``-ed over exactly the batch axes the parameter is
  replicated on (:func:`reduce_grads`).
* **FSDP / ZeRO-3** (``fsdp``, or ``data``+``fsdp`` with the ``zero3`` preset): the manual-mode model
  ``all_gather``-s a weight right before use; autodiff transposes that into the ``psum_scatter`` of
  its gradient, so gradients come out sharded like the parameters.
* **Megatron TP** (``tensor``): column/row-parallel matmuls, ``psum`` after the row-parallel ones
  (framework/model.py), and a vocab-parallel cross-entropy (``pmax``/``psum`` over ``tensor``) when
  the LM head is vocab-sharded, so full-vocab logits never exist on one device.
* **SP** (``sequence``): each device holds a slice of the sequence; attention ``all_gather``-s K/V
  (and their positions) along ``sequence``.
* **PP** (``pipeline`` > 1): parallelism/pipeline.py (GPipe / 1F1B over ``ppermute``). The jit form
  with ``pipeline > 1`` is built here too: a shard_map manual over 'pipeline' only.

``mesh.microbatches`` only matters with ``pipeline > 1`` (there is no gradient accumulation in the
non-pipelined step). Mesh axes of size 1 are dropped from the shard_map specs (:func:`strip_trivial`),
so the jaxpr holds only collectives that move data.

Structure: the ``shard_map`` computes (loss, grads) with grads sharded like the params; the optax
update runs outside it under the same ``jax.jit`` (element-wise AdamW plus one global-norm
reduction, which GSPMD partitions without help), with in/out shardings and state donation.

Loss normalisation: every device divides its *sum* of token losses by the *global* token count
and the partial losses are ``psum``-ed, so the loss (and hence every gradient) equals the
single-device mean exactly up to float reassociation.

``check_vma=True`` (jax's varying-manual-axes typing) is kept on, on purpose: with it, autodiff
knows which values are replicated over an axis, so the transpose of an implicit broadcast
(``pvary``) is a ``psum`` and the transpose of a ``psum`` of a varying value is a broadcast. That is
exactly what makes Megatron TP gradients right without hand-written ``f``/``g`` operators (with
``check_vma=False`` a ``psum``'s transpose is another ``psum`` and TP gradients come out ``tensor``
times too large). The price is that carries of ``scan``/``cond`` must have consistent types;
:func:`vary` does that bookkeeping.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from framework import model as model_lib
from framework import optim, train_step as ts
from framework.config import Config, ConfigError
from parallelism import rules as rules_lib
from parallelism import step as step_lib

# Axes a batch is split over; a parameter replicated over one of them gets its gradient summed over it.
BATCH_AXES = ("data", "fsdp", "sequence")
TENSOR_AXIS = "tensor"
SEQUENCE_AXIS = "sequence"
PIPELINE_AXIS = "pipeline"


# ----------------------------------------------------------------------------------------------
# Small typed helpers for varying-manual-axes (vma) bookkeeping.

def spec_axes(spec: P) -> tuple:
  """Mesh axes a PartitionSpec shards over (flattened)."""
  out = []
  for entry in spec:
    if entry is None:
      continue
    out.extend((entry,) if isinstance(entry, str) else entry)
  return tuple(out)


def varying_axes(x) -> frozenset:
  """Mesh axes over which ``x`` may differ between devices (jax's vma type of a shard_map value)."""
  aval = jax.typeof(x)
  if hasattr(aval, "vma"):  # jax <= 0.9 spelling
    return frozenset(aval.vma)
  return frozenset(aval.manual_axis_type.varying)


def vary(x, axes: Sequence[str]):
  """Marks ``x`` as varying over ``axes`` (no data movement); axes it already varies over are skipped."""
  have = varying_axes(x)
  missing = tuple(a for a in axes if a not in have)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def strip_trivial(spec: P, mesh: Mesh, manual_axes=None) -> P:
  """Drops size-1 mesh axes from a spec. Inside shard_map a value is then never typed as varying over
  an axis that does not exist physically, so no size-1 collective (a no-op that would still show
  up in the jaxpr the performance model reads) is ever needed. With ``manual_axes`` (a partially
  manual shard_map) axes outside it are dropped too: GSPMD shards those."""
  def keep(entry):
    if entry is None:
      return None
    axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry)
                 if mesh.shape[a] > 1 and (manual_axes is None or a in manual_axes))
    return None if not axes else (axes[0] if len(axes) == 1 else axes)
  return P(*(keep(e) for e in spec))


def active(axes: Sequence[str], mesh: Mesh) -> tuple:
  return tuple(a for a in axes if mesh.shape[a] > 1)


def reduce_axes_for(spec: P, candidate_axes: Sequence[str]) -> tuple:
  """The batch-like axes a parameter is replicated over: its gradient must be summed over them."""
  sharded = spec_axes(spec)
  return tuple(a for a in candidate_axes if a not in sharded)


def localize_params(params, specs, candidate_axes: Sequence[str]):
  """Device-local view of the params: differentiating w.r.t. it yields per-device partial grads
  (no implicit all-reduce), which :func:`reduce_grads` then sums explicitly, once."""
  return jax.tree.map(lambda p, s: vary(p, reduce_axes_for(s, candidate_axes)), params, specs)


def reduce_grads(grads, specs, candidate_axes: Sequence[str]):
  """Data-parallel gradient all-reduce: psum each gradient over the axes its param is replicated on."""
  def red(g, s):
    axes = reduce_axes_for(s, candidate_axes)
    return jax.lax.psum(g, axes) if axes else g
  return jax.tree.map(red, grads, specs)


def positions(shape_BxT, sequence_size: int, sequence_axis: str = SEQUENCE_AXIS):
  """Global token positions of this device's sequence slice (sequence parallelism offsets them)."""
  b, t = shape_BxT
  pos_T = jnp.arange(t, dtype=jnp.int32)
  if sequence_size > 1:
    pos_T = pos_T + jax.lax.axis_index(sequence_axis) * t
  return jnp.broadcast_to(pos_T, (b, t))


def vocab_parallel_cross_entropy(logits_BxTxVl, targets_BxT, axis: str = TENSOR_AXIS):
  """Per-token cross-entropy when each device on ``axis`` holds a contiguous vocab shard.

  Megatron-style: a global max (``pmax``) for stability, a ``psum`` of the local sums of exponentials
  for the log-partition, and a ``psum`` of the target logit, which lives on exactly one shard."""
  logits = logits_BxTxVl.astype(jnp.float32)
  v_local = logits.shape[-1]
  # The max only stabilises the exponent; its gradient cancels, so it is treated as a constant.
  m_BxT = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), axis)
  sumexp_BxT = jax.lax.psum(jnp.sum(jnp.exp(logits - m_BxT[..., None]), axis=-1), axis)
  lse_BxT = jnp.log(sumexp_BxT) + m_BxT
  local_BxT = targets_BxT - jax.lax.axis_index(axis) * v_local
  mine_BxT = (local_BxT >= 0) & (local_BxT < v_local)
  picked_BxT = jnp.take_along_axis(logits, jnp.clip(local_BxT, 0, v_local - 1)[..., None], axis=-1)[..., 0]
  tgt_BxT = jax.lax.psum(jnp.where(mine_BxT, picked_BxT, 0.0), axis)
  return lse_BxT - tgt_BxT


def token_loss_sum(model: model_lib.Transformer, logits, targets_BxT):
  """Sum of per-token cross-entropies on this device (vocab-parallel when the head is vocab-sharded)."""
  if model.vocab_sharded_logits:
    return jnp.sum(vocab_parallel_cross_entropy(logits, targets_BxT))
  return jnp.sum(ts.cross_entropy(logits, targets_BxT))


# ----------------------------------------------------------------------------------------------
# Building the step.

def manual_ctx(mesh: Mesh, rules: tuple) -> model_lib.ParallelCtx:
  return model_lib.ParallelCtx(manual=True, rules=rules, axis_sizes=tuple(mesh.shape.items()),
                               tensor_axis=TENSOR_AXIS, sequence_axis=SEQUENCE_AXIS)


def _loss_and_grads_body(params, inputs_BxT, targets_BxT, *, model, specs, n_tokens: int, batch_axes: tuple):
  """Per-device (loss, grads) for the non-pipelined layouts. Runs inside shard_map."""
  local = localize_params(params, specs, batch_axes)
  pos_BxT = positions(inputs_BxT.shape, model.ctx.size((SEQUENCE_AXIS,)))

  def local_loss(p):
    logits = model.apply({"params": p}, inputs_BxT, pos_BxT)
    return token_loss_sum(model, logits, targets_BxT) / n_tokens

  loss, grads = jax.value_and_grad(local_loss)(local)
  loss = jax.lax.psum(loss, batch_axes) if batch_axes else loss
  return loss, reduce_grads(grads, specs, batch_axes)


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


def build(cfg: Config, mesh: Mesh, donate: bool = True) -> step_lib.CompiledStep:
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
  model = model_lib.build(cfg.model)  # auto mode, full shapes: init / eval / sampling
  tx = optim.make(cfg.optim, cfg.train.steps)
  ctx = step_lib._Context(mesh, rules)  # noqa: SLF001 - same mesh+rules context as the jit form
  with ctx:
    boxed = jax.eval_shape(functools.partial(ts.init_state, model=model, tx=tx), step_lib.abstract_key())
    state_sh = step_lib.state_shardings_for(boxed, mesh, rules)
  n_tokens = cfg.data.global_batch * cfg.data.seq_len
  if all_manual:
    manual_axes = frozenset(mesh.axis_names)
    inner = model_lib.build(cfg.model, manual_ctx(mesh, rules))
    batch_axes = active(BATCH_AXES, mesh)
  else:
    # Manual over 'pipeline' only; the stage model is an ordinary auto-mode model of L/P layers.
    manual_axes = frozenset({PIPELINE_AXIS})
    inner = model_lib.build(dataclasses.replace(cfg.model, n_layers=cfg.model.n_layers // cfg.mesh.pipeline))
    batch_axes = ()
  # shard_map specs: the same logical rules restricted to the manual axes, minus size-1 axes.
  param_specs = jax.tree.map(lambda s: strip_trivial(s.spec, mesh, manual_axes), state_sh.params)
  batch_spec = strip_trivial(step_lib.BATCH_SPEC, mesh, manual_axes)
  batch_sh = {k: NamedSharding(mesh, step_lib.BATCH_SPEC) for k in ("inputs", "targets")}
  replicated = NamedSharding(mesh, P())

  if pipelined:
    from parallelism import pipeline  # noqa: PLC0415 - pipeline imports this module's helpers
    body = pipeline.loss_and_grads_body(cfg, inner, param_specs, n_tokens, batch_axes, masked=not all_manual)
  else:
    body = functools.partial(_loss_and_grads_body, model=inner, specs=param_specs, n_tokens=n_tokens,
                             batch_axes=batch_axes)
  loss_and_grads = shard_map(body, mesh=mesh, in_specs=(param_specs, batch_spec, batch_spec),
                             out_specs=(P(), param_specs), axis_names=manual_axes, check_vma=True)

  def step(state: ts.TrainState, batch):
    loss, grads = loss_and_grads(state.params, batch["inputs"], batch["targets"])
    metrics = ts.StepMetrics(loss=loss, grad_norm=optax.tree.norm(grads),
                             n_tokens=jnp.asarray(n_tokens, jnp.int32))
    return ts.apply_grads(state, grads, tx), metrics

  def init(rng):
    return nn.unbox(ts.init_state(rng, model, tx))

  init_fn = jax.jit(init, out_shardings=state_sh)
  # Donating the state lets XLA update parameters and optimizer moments in place.
  step_fn = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                    donate_argnums=(0,) if donate else ())
  out = step_lib.CompiledStep(cfg=cfg, mesh=mesh, model=model, tx=tx, rules=rules, state_shardings=state_sh,
                              batch_shardings=batch_sh, step_fn=step_fn, init_fn=init_fn)
  # For tests and the performance model: the bare shard_map, (params, inputs, targets) -> (loss, grads),
  # to be called under jit with the mesh context (``with out.context(): jax.jit(out.loss_and_grads)(...)``).
  out.loss_and_grads = loss_and_grads
  return out
