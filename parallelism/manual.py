"""Helpers for code that runs per device inside ``jax.shard_map``: axis names, specs, vma typing,
gradient reduction, token positions and the vocab-parallel cross-entropy.

Used by the shard_map step (parallelism/shard_map_step.py) and the pipeline (parallelism/pipeline.py).

``check_vma=True`` (jax's varying-manual-axes typing) is kept on, on purpose: with it, autodiff
knows which values are replicated over an axis, so the transpose of an implicit broadcast
(``pvary``) is a ``psum`` and the transpose of a ``psum`` of a varying value is a broadcast. That is
exactly what makes Megatron TP gradients right without hand-written ``f``/``g`` operators (with
``check_vma=False`` a ``psum``'s transpose is another ``psum`` and TP gradients come out ``tensor``
times too large). The price is that carries of ``scan``/``cond`` must have consistent types;
:func:`vary` does that bookkeeping.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from framework import model as model_lib
from framework import train_step as ts

# Axes a batch is split over; a parameter replicated over one of them gets its gradient summed over it.
BATCH_AXES = ("data", "fsdp", "expert", "sequence")
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
SEQUENCE_AXIS = "sequence"
PIPELINE_AXIS = "pipeline"


def manual_ctx(mesh: Mesh, rules: tuple, layer_repeats: int = 1,
               tensor_sequence_parallel: bool = False) -> model_lib.ParallelCtx:
  """The model's view of a mesh all of whose axes are manual (it writes its own TP/SP collectives);
  ``layer_repeats``: the layer stack's virtual-stage chunks (parallelism.pipeline.layer_repeats);
  ``tensor_sequence_parallel``: Megatron sequence parallelism over 'tensor' (``mesh.tensor_sequence_parallel``)."""
  return model_lib.ParallelCtx(manual=True, rules=rules, axis_sizes=tuple(mesh.shape.items()),
                               tensor_axis=TENSOR_AXIS, sequence_axis=SEQUENCE_AXIS, expert_axis=EXPERT_AXIS,
                               layer_repeats=layer_repeats,
                               tensor_sequence_parallel=tensor_sequence_parallel)


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


def zeros_like_typed(x):
  """Zeros with x's shape, dtype *and* varying-axes type (cond branches and scan carries must agree)."""
  return vary(jnp.zeros(x.shape, x.dtype), tuple(varying_axes(x)))


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
  """The axes of ``axes`` that have size > 1 on ``mesh``."""
  return tuple(a for a in axes if mesh.shape[a] > 1)


def reduce_axes_for(spec: P, candidate_axes: Sequence[str]) -> tuple:
  """The batch-like axes a parameter is replicated over: its gradient must be summed over them."""
  sharded = spec_axes(spec)
  return tuple(a for a in candidate_axes if a not in sharded)


def localize_params(params, specs, candidate_axes: Sequence[str]):
  """Device-local view of the params: differentiating w.r.t. it yields per-device partial grads
  (no implicit all-reduce), which :func:`reduce_grads` then sums explicitly, once."""
  return jax.tree.map(lambda p, s: vary(p, reduce_axes_for(s, candidate_axes)), params, specs)


def added_axes(spec: P, wider: P):
  """(dim, axes): the one dim where ``wider`` shards over more mesh axes than ``spec``, and those axes in
  ``wider``'s order; (None, ()) when the two are the same (ZeRO-1 specs, parallelism/zero.py)."""
  for dim in range(max(len(spec), len(wider))):
    have = spec_axes(P(spec[dim])) if dim < len(spec) else ()
    want = spec_axes(P(wider[dim])) if dim < len(wider) else ()
    if have != want:
      if want[:len(have)] != have:
        raise ValueError(f"{wider} does not extend {spec} on dim {dim}")
      return dim, want[len(have):]
  return None, ()


def reduce_grads(grads, specs, candidate_axes: Sequence[str], grad_specs=None, dtype=None):
  """Data-parallel gradient reduction: sum each gradient over the axes its param is replicated on.

  Plain: a ``psum`` (all-reduce). With ``grad_specs`` (ZeRO-1: the params' specs with data-parallel axes added
  to one dim), the sum over the added axes is a ``psum_scatter`` (reduce-scatter) onto that dim, so each
  device keeps only its shard. ``dtype``: cast before summing (float32 gradients of bf16 parameters)."""
  def red(g, s, gs):
    g = g if dtype is None else g.astype(dtype)
    dim, scatter = added_axes(s, gs)
    rest = tuple(a for a in reduce_axes_for(s, candidate_axes) if a not in scatter)
    g = jax.lax.psum(g, rest) if rest else g
    if not scatter:
      return g
    n = math.prod(jax.lax.axis_size(a) for a in scatter)  # padded to a multiple where none divides (zero.plan)
    g = jnp.pad(g, [(0, (-g.shape[dim]) % n if d == dim else 0) for d in range(g.ndim)]) if g.shape[dim] % n else g
    return jax.lax.psum_scatter(g, scatter, scatter_dimension=dim, tiled=True)
  return jax.tree.map(red, grads, specs, specs if grad_specs is None else grad_specs)


def positions(shape_BxT, sequence_size: int, sequence_axis: str = SEQUENCE_AXIS, zigzag: bool = False):
  """Global token positions of this device's sequence slice (sequence parallelism offsets them); ``zigzag``: of
  its chunks ``i`` and ``2C-1-i`` (:func:`zigzag`)."""
  b, t = shape_BxT
  pos_T = jnp.arange(t, dtype=jnp.int32)
  if sequence_size > 1 and zigzag:
    i, n = jax.lax.axis_index(sequence_axis), t // 2
    pos_T = jnp.where(pos_T < n, i * n + pos_T, (2 * sequence_size - 1 - i) * n + pos_T - n)
  elif sequence_size > 1:
    pos_T = pos_T + jax.lax.axis_index(sequence_axis) * t
  return jnp.broadcast_to(pos_T, (b, t))


def zigzag(x_BxT, sequence_size: int, sequence_axis: str = SEQUENCE_AXIS):
  """This device's contiguous slice of the sequence -> chunks ``i`` and ``2C-1-i`` of the ``2C`` equal chunks
  (C = ``sequence_size``, i = this device): the layout in which ring attention's causal work is the same on every
  device (Llama 3 / NeMo context parallelism). Moves token ids only (an all-gather of B x T int32)."""
  full_BxT = jax.lax.all_gather(x_BxT, sequence_axis, axis=1, tiled=True)
  i, n = jax.lax.axis_index(sequence_axis), x_BxT.shape[1] // 2
  first = jax.lax.dynamic_slice_in_dim(full_BxT, i * n, n, axis=1)
  second = jax.lax.dynamic_slice_in_dim(full_BxT, (2 * sequence_size - 1 - i) * n, n, axis=1)
  return jnp.concatenate([first, second], axis=1)


def sequence_layout(model: model_lib.Transformer, inputs_BxT, targets_BxT):
  """(inputs, targets, positions) of this device's tokens: its contiguous slice of the sequence, or with ring
  attention over a sequence axis of size > 1 its zig-zag chunks. The loss is a sum over tokens, so the order in
  which a device holds them changes nothing else."""
  c = model.ctx.size((SEQUENCE_AXIS,))
  ring = model.cfg.attention == "ring" and c > 1
  if ring:
    inputs_BxT, targets_BxT = zigzag(inputs_BxT, c), zigzag(targets_BxT, c)
  return inputs_BxT, targets_BxT, positions(inputs_BxT.shape, c, zigzag=ring)


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
