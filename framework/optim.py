"""AdamW with linear warm-up and cosine decay, global-norm clipping (optax), optional float32 master weights.

:func:`apply` is the one way a step applies gradients: with master weights the new parameters are the cast of
the updated masters, not ``params + updates``.

The clipping takes the global norm as an optional extra argument (``global_norm=``): a step that holds only
its shard of every gradient (the explicit ZeRO-1 update, parallelism/zero.py) computes the norm with its own
collectives and passes it; without it the norm is computed from the gradients given, as optax does.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from framework.config import OptimConfig


class MasterState(NamedTuple):
  """Optimizer state with float32 master copies of the parameters (``optim.master_weights``)."""
  master: Any  # float32, same tree as the params
  inner: Any  # the AdamW state, on the masters


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  decay = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
  return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1), decay, cfg.lr * cfg.min_lr_ratio)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """``optax.clip_by_global_norm`` (same arithmetic, same empty state) with the norm optionally given."""
  def update(updates, state, params=None, *, global_norm=None, **extra):
    del params, extra
    norm = optax.tree.norm(updates) if global_norm is None else global_norm
    trigger = jnp.squeeze(norm < max_norm)
    return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), updates), state
  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def with_master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``inner`` run on float32 masters of the params: gradients are cast to float32, the masters updated; the
  returned updates are the masters' (float32), so apply them with :func:`apply`."""
  def init(params):
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return MasterState(master, inner.init(master))

  def update(grads, state, params=None, **extra):
    del params
    grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, inner_state = inner.update(grads32, state.inner, state.master, **extra)
    return updates, MasterState(optax.apply_updates(state.master, updates), inner_state)
  return optax.GradientTransformationExtraArgs(init, update)


def make(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformationExtraArgs:
  return with_master_weights(_adamw(cfg, total_steps)) if cfg.master_weights else _adamw(cfg, total_steps)


def decayed(path, leaf) -> bool:
  """Weight decay for the model's matrices only (Llama, Megatron): not norms' scales, biases or a MoE router's
  balancing bias (framework/model.py NOT_DECAYED), by the parameter's name, not its array rank: a scanned layer
  stack adds a leading layer axis, so a norm's scale is 2-D there (L x D) and still a vector."""
  from framework.model import NOT_DECAYED, PARAM_AXES  # noqa: PLC0415 (the model's declaration of its parameters)
  name = str(getattr(path[-1], "key", getattr(path[-1], "name", ""))) if path else ""
  if name in PARAM_AXES:
    return name not in NOT_DECAYED
  return getattr(leaf, "ndim", 0) >= 2  # a parameter the model does not declare (e.g. a test's own tree)


def _adamw(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  def mask(params):
    return jax.tree_util.tree_map_with_path(decayed, params)
  tx = optax.chain(
      clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
      optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay, mask=mask))
  return tx


def apply(tx: optax.GradientTransformation, grads, opt_state, params, **extra):
  """One optimizer update: (new params, new optimizer state). ``extra``: e.g. ``global_norm`` (above)."""
  updates, opt_state = tx.update(grads, opt_state, params, **extra)
  if isinstance(opt_state, MasterState):  # masters may be padded (ZeRO-1 over an odd size: parallelism/zero.py)
    return jax.tree.map(lambda m, p: crop(m, p.shape).astype(p.dtype), opt_state.master, params), opt_state
  return optax.apply_updates(params, updates), opt_state


def pad(x, shape):
  """``x`` zero-padded at the end of each dim up to ``shape`` (optimizer state kept in a padded layout,
  parallelism/zero.py: zeros have zero gradients, moments and AdamW updates, so they stay zero)."""
  if tuple(x.shape) == tuple(shape):
    return x
  return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape)])


def crop(x, shape):
  """The leading ``shape`` of ``x``: undoes :func:`pad`."""
  if tuple(x.shape) == tuple(shape):
    return x
  return x[tuple(slice(0, s) for s in shape)]


def grad_dtype(opt_state):
  """The dtype gradients are summed in (over devices and micro-batches): float32 with master weights (as
  Megatron's float32 main gradients), else None (the parameters' dtype)."""
  return jnp.float32 if isinstance(opt_state, MasterState) else None


def grad_params(params, opt_state, compute_dtype):
  """The parameters a step differentiates: with master weights, cast to the compute dtype (``model.dtype``),
  so that gradients are not rounded to a narrower parameter dtype before they are summed over devices (with
  bf16 compute this is the parameters themselves); otherwise the parameters as stored."""
  if isinstance(opt_state, MasterState):
    return jax.tree.map(lambda p: p.astype(compute_dtype), params)
  return params
