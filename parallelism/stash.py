"""A vjp split in two halves that can run in different pipeline ticks: forward now, backward later.

``jax.vjp`` returns its pullback as a pytree whose leaves are the residuals (what the backward pass reads). A
pipeline's forward slot keeps them until the unit's backward slot, but not all of them: residuals that depend
only on the parameters (FSDP all-gathered weights, dtype casts of weights, RoPE tables of the fixed positions) are
the same for every micro-batch, so stashing them would multiply the weights by the number of stash slots. They
are recomputed in the backward slot instead (where ZeRO-3 re-gathers weights anyway), and only the residuals that
depend on the micro-batch's activation are stashed.

Which is which is decided once, at trace time, by partial evaluation of the forward-with-residuals jaxpr with the
parameters known and the activation unknown (``jax._src.interpreters.partial_eval``: jax has no public API for
it; tests/parallelism/test_stash.py covers its use). What gets stashed is therefore whatever ``model.remat`` lets
the backward keep: everything for ``none``, one input per layer for ``full``.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as jcore

from parallelism import manual


class SplitVjp:
  """``fn(params, x) -> y`` differentiated in two halves; built once per trace from example (typed) inputs."""

  def __init__(self, fn: Callable, params, x):
    self._fn = fn
    box = {}

    def with_residuals(prm, x_in):
      y, pullback = jax.vjp(fn, prm, x_in)
      leaves, box["treedef"] = jax.tree.flatten(pullback)
      return y, leaves

    closed = jax.make_jaxpr(with_residuals)(params, x)
    self._treedef = box["treedef"]
    n_prm, n_x = len(jax.tree.leaves(params)), len(jax.tree.leaves(x))
    self._n_y = len(jax.tree.leaves(jax.eval_shape(fn, params, x)))
    known, _, out_unknown, _ = pe.partial_eval_jaxpr_nounits(closed, [False] * n_prm + [True] * n_x,
                                                             instantiate=False)
    if not all(out_unknown[:self._n_y]):
      raise ValueError("a pipeline stage's output must depend on its input activation")
    self._stashed = out_unknown[self._n_y:]  # per residual: True = depends on the activation
    self.stash_avals = [a for a, u in zip(closed.out_avals[self._n_y:], self._stashed) if u]
    # The known jaxpr's outputs: the known outputs of `closed` in order, then residuals of its unknown half.
    n_known = sum(not u for u in out_unknown)
    used = [True] * n_known + [False] * (len(known.jaxpr.outvars) - n_known)
    jaxpr, _ = pe.dce_jaxpr(known.jaxpr, used, instantiate=True)
    self._known = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, known.consts))

  def forward(self, params, x):
    """(y, the residuals to stash)."""
    y, pullback = jax.vjp(self._fn, params, x)
    leaves = jax.tree.leaves(pullback)
    return y, [r for r, u in zip(leaves, self._stashed) if u]

  def backward(self, params, stashed: list, dy):
    """(d params, d x) from the stashed residuals, recomputing the parameter-only ones from ``params``."""
    known = iter(self._known(*jax.tree.leaves(params)))
    stashed = iter(stashed)
    leaves = [next(stashed) if u else next(known) for u in self._stashed]
    return jax.tree.unflatten(self._treedef, leaves)(dy)

  def zeros(self, *lead: int) -> list:
    """Empty stash buffers: ``lead`` (e.g. slots x layers) x each stashed residual, typed like it (shard_map
    varying axes) and in its memory space (residuals a ``*_offloaded`` remat policy moved to host memory are
    stashed there)."""
    out = []
    for a in self.stash_avals:
      buf = jnp.zeros(tuple(lead) + a.shape, a.dtype)
      if getattr(a, "memory_space", None) == jax.memory.Space.Host:
        buf = jax.device_put(buf, jax.memory.Space.Host)
      out.append(manual.vary(buf, tuple(a.manual_axis_type.varying)) if hasattr(a, "manual_axis_type") else buf)
    return out

  def stash_bytes(self) -> int:
    """Bytes of one unit's stashed residuals (per device)."""
    return sum(a.size * a.dtype.itemsize for a in self.stash_avals)
