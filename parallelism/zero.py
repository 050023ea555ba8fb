"""ZeRO-1 (Megatron's distributed optimizer; MaxText's ``shard_optimizer_over_data``): the optimizer state
sharded over the data-parallel axes, ``optim.shard_optimizer_state=True``.

**Layout.** Every optimizer-state leaf keeps its parameter's sharding (``mesh.rules``) and is additionally
split over the data-parallel axes (``data``, ``fsdp``, ``expert``, ``sequence``, those of size > 1) that the parameter is
replicated on, i.e. exactly the axes its gradient is summed over. All of those axes go onto one dim: the first
whose per-device size they divide (:func:`zero_spec`). A leaf with no such dim (or a scalar, such as Adam's step
count) stays as it was, replicated over those axes, without an error: its state is then held in full on every
device, which only small leaves (norm scales of odd widths) ever hit. Parameters keep the layout of the rules:
ZeRO-1 shards the optimizer, not the weights (that is ``mesh.rules=zero3`` / FSDP).

**jit form.** The state's shardings say it; the gradients are constrained to the same shardings before the
update (``train_step(grad_shardings=...)``), so GSPMD reduce-scatters them, runs the element-wise AdamW on each
device's shard and all-gathers the updated parameters into their own sharding.

**shard_map form.** Written out: the step's shard_map reduce-scatters every gradient over the added axes
(``psum_scatter``, :func:`parallelism.manual.reduce_grads` with ``grad_specs``) instead of all-reducing it;
a second shard_map (:func:`sharded_update`) takes each device's shard of gradients, optimizer state and
parameters, computes the global gradient norm (one ``psum`` of squared norms per set of sharded axes), runs
the optimizer on the shard and ``all_gather``-s the updated parameters back to their own sharding.

With ``optim.master_weights`` the float32 masters are part of the optimizer state, so they are sharded the same
way, and the all-gather moves parameters in their own (bf16) dtype, as in Megatron.
"""
from __future__ import annotations

import math
from collections import defaultdict

import jax
import jax.numpy as jnp
from jax import shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from framework import optim
from parallelism import manual

ZERO_AXES = manual.BATCH_AXES  # the data-parallel axes: a gradient is summed over those its param is replicated on


def zero_spec(spec: P, shape: tuple, mesh: Mesh) -> P:
  """``spec`` with the data-parallel axes the leaf is replicated on added to one dim (see the module doc);
  ``spec`` itself when none is left or no dim divides."""
  sizes = dict(mesh.shape)
  have = manual.spec_axes(spec)
  extra = tuple(a for a in ZERO_AXES if a not in have and sizes[a] > 1)
  if not extra or not shape:
    return spec
  n = math.prod(sizes[a] for a in extra)
  entries = list(spec) + [None] * (len(shape) - len(spec))
  for dim, (size, entry) in enumerate(zip(shape, entries)):
    cur = manual.spec_axes(P(entry))
    if (size // math.prod(sizes[a] for a in cur)) % n == 0:
      axes = cur + extra
      entries[dim] = axes[0] if len(axes) == 1 else axes
      return P(*entries)
  return spec


def shard_tree(shardings, shapes, mesh: Mesh):
  """A tree of NamedSharding with :func:`zero_spec` applied leaf by leaf (``shapes``: same tree, abstract)."""
  return jax.tree.map(lambda sh, x: NamedSharding(mesh, zero_spec(sh.spec, x.shape, mesh)), shardings, shapes)


def global_norm(grads, specs):
  """Global L2 norm of gradients of which each device holds the shard ``specs`` says: per set of sharded axes,
  one ``psum`` of the local sums of squares (a leaf replicated over an axis is counted once). Inside shard_map."""
  groups = defaultdict(list)
  for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
    groups[manual.spec_axes(s)].append(jnp.sum(jnp.square(g.astype(jnp.float32))))
  total = jnp.zeros((), jnp.float32)
  for axes, parts in groups.items():
    local = sum(parts[1:], parts[0])
    total = total + (jax.lax.psum(local, axes) if axes else local)
  return jnp.sqrt(total)


def sharded_update(tx, mesh: Mesh, param_specs, grad_specs, opt_specs):
  """The explicit ZeRO-1 update, a shard_map (params, opt_state, grads) -> (params, opt_state, grad_norm).

  Specs are shard_map specs (size-1 axes stripped). ``grads`` arrive in ``grad_specs`` (reduce-scattered);
  ``params`` are taken in ``grad_specs`` too, which is a local slice of a replicated array (no communication);
  updated parameters leave in ``param_specs`` through an explicit all-gather over the added axes."""

  def gather(p, s, gs):
    dim, axes = manual.added_axes(s, gs)
    return jax.lax.all_gather(p, axes, axis=dim, tiled=True, to="invarying") if axes else p

  def body(params, opt_state, grads):
    norm = global_norm(grads, grad_specs)
    params, opt_state = optim.apply(tx, grads, opt_state, params, global_norm=norm)
    return jax.tree.map(gather, params, param_specs, grad_specs), opt_state, norm

  return shard_map(body, mesh=mesh, in_specs=(grad_specs, opt_specs, grad_specs),
                   out_specs=(param_specs, opt_specs, P()), check_vma=True)
