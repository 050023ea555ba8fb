"""ZeRO-1 (Megatron's distributed optimizer; MaxText's ``shard_optimizer_over_data``): the optimizer state
sharded over the data-parallel axes, ``optim.shard_optimizer_state=True``.

**Layout.** Every optimizer-state leaf keeps its parameter's sharding (``mesh.rules``) and is additionally
split over the data-parallel axes (``data``, ``fsdp``, ``expert``, ``sequence``, those of size > 1) that the parameter is
replicated on, i.e. exactly the axes its gradient is summed over. All of those axes go onto one dim: the first
whose per-device size they divide (:func:`plan`). When none divides (48 data-parallel ranks and power-of-two
widths, as in Megatron's runs), the state is kept **padded**: the largest dim no axis shards yet is padded with
zeros up to a multiple of their size and split there, as Megatron pads its flat buffer to a multiple of the
data-parallel size (a dim only size-1 axes shard counts as unsharded). Zeros have zero gradients, moments and AdamW updates, so the padding stays zero and the
update equals the unpadded one. Only a leaf with no such dim at least as large as the data-parallel size (or a
scalar, such as Adam's step count) stays replicated over those axes. Parameters keep the layout of the rules
and their own shape: ZeRO-1 shards the optimizer, not the weights (that is ``mesh.rules=zero3`` / FSDP).
:func:`padded` wraps the optimizer so that its state is created and updated in the padded shapes.

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
import optax
from jax import shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from framework import optim
from parallelism import manual

ZERO_AXES = manual.BATCH_AXES  # the data-parallel axes: a gradient is summed over those its param is replicated on


def plan(spec: P, shape: tuple, mesh: Mesh) -> tuple[P, tuple]:
  """(spec, shape) of a leaf's optimizer state: ``spec`` with the data-parallel axes the leaf is replicated on
  added to one dim, and the leaf's shape, padded on that dim when no dim divides (see the module doc)."""
  shape = tuple(shape)
  sizes = dict(mesh.shape)
  have = manual.spec_axes(spec)
  extra = tuple(a for a in ZERO_AXES if a not in have and sizes[a] > 1)
  if not extra or not shape:
    return spec, shape
  n = math.prod(sizes[a] for a in extra)
  entries = list(spec) + [None] * (len(shape) - len(spec))

  def split(dim):
    axes = manual.spec_axes(P(entries[dim])) + extra
    return P(*entries[:dim], axes[0] if len(axes) == 1 else axes, *entries[dim + 1:])
  for dim, (size, entry) in enumerate(zip(shape, entries)):
    if (size // math.prod(sizes[a] for a in manual.spec_axes(P(entry)))) % n == 0:
      return split(dim), shape
  free = [dim for dim, (size, entry) in enumerate(zip(shape, entries))
          if size >= n and math.prod(sizes[a] for a in manual.spec_axes(P(entry))) == 1]
  if not free:
    return spec, shape
  dim = max(free, key=lambda d: shape[d])
  return split(dim), shape[:dim] + (-(-shape[dim] // n) * n,) + shape[dim + 1:]


def zero_spec(spec: P, shape: tuple, mesh: Mesh, pad: bool = True) -> P:
  """The optimizer state's spec of a leaf of ``shape`` (:func:`plan`); ``pad=False``: ``spec`` itself where
  the layout needs padding (an array of the unpadded shape, e.g. the jit form's gradients before the update)."""
  new, padded = plan(spec, shape, mesh)
  return new if pad or padded == tuple(shape) else spec


def shard_tree(shardings, shapes, mesh: Mesh, pad: bool = True):
  """A tree of NamedSharding with :func:`zero_spec` applied leaf by leaf (``shapes``: same tree, abstract)."""
  return jax.tree.map(lambda sh, x: NamedSharding(mesh, zero_spec(sh.spec, x.shape, mesh, pad)), shardings, shapes)


def padded(tx, shardings, shapes, mesh: Mesh):
  """``tx`` with its state in the padded shapes of :func:`plan` (params' ``shardings`` and abstract ``shapes``,
  same tree): ``init`` pads the params, ``update`` pads gradients and params and crops the updates back. ``tx``
  itself when no leaf needs padding. Trees are matched leaf by leaf in order, so boxed params work too."""
  want = [plan(sh.spec, x.shape, mesh)[1] for sh, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes))]
  if all(w == tuple(x.shape) for w, x in zip(want, jax.tree.leaves(shapes))):
    return tx

  def pad_tree(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([optim.pad(x, w) for x, w in zip(leaves, want)])

  def init(params):
    return tx.init(pad_tree(params))

  def update(grads, state, params=None, **extra):
    updates, state = tx.update(pad_tree(grads), state, None if params is None else pad_tree(params), **extra)
    return jax.tree.map(lambda u, g: optim.crop(u, g.shape), updates, grads), state
  return optax.GradientTransformationExtraArgs(init, update)


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
  """The explicit ZeRO-1 update, (params, opt_state, grads) -> (params, opt_state, grad_norm), a shard_map.

  Specs are shard_map specs (size-1 axes stripped). ``grads`` arrive in ``grad_specs`` (reduce-scattered, in
  the padded shapes of :func:`plan`); ``params`` are padded to the gradients' shapes and taken in ``grad_specs``
  too, which is a local slice of a replicated array (no communication); updated parameters leave in
  ``param_specs`` through an explicit all-gather over the added axes and are cropped to their own shape.
  ``tx``: the optimizer itself, not :func:`padded` (its shards are already padded)."""

  def gather(p, s, gs):
    dim, axes = manual.added_axes(s, gs)
    return jax.lax.all_gather(p, axes, axis=dim, tiled=True, to="invarying") if axes else p

  def body(params, opt_state, grads):
    norm = global_norm(grads, grad_specs)
    params, opt_state = optim.apply(tx, grads, opt_state, params, global_norm=norm)
    return jax.tree.map(gather, params, param_specs, grad_specs), opt_state, norm

  fn = shard_map(body, mesh=mesh, in_specs=(grad_specs, opt_specs, grad_specs),
                 out_specs=(param_specs, opt_specs, P()), check_vma=True)

  def update(params, opt_state, grads):
    new, opt_state, norm = fn(jax.tree.map(lambda p, g: optim.pad(p, g.shape), params, grads), opt_state, grads)
    return jax.tree.map(lambda n, p: optim.crop(n, p.shape), new, params), opt_state, norm
  return update
