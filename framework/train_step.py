"""The pure train step: ``train_step(state, batch) -> (state, metrics)``.

No mesh, no I/O, no globals: everything else (jit with shardings, shard_map, the pipeline,
resilience wrappers, the performance model's tracer) wraps or compiles this function.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from framework import fp8
from framework import model as model_lib
from framework import moe as moe_lib
from framework import optim


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


class StepMetrics(NamedTuple):
  loss: jax.Array  # mean next-byte cross-entropy, nats/token
  grad_norm: jax.Array
  n_tokens: jax.Array
  expert_load: Any = None  # mixture of experts: assignments per layer and expert in the step's batch, L x E


def cross_entropy(logits_BxTxV, targets_BxT):
  """Per-token cross-entropy in float32 (full vocab on this device)."""
  logits = logits_BxTxV.astype(jnp.float32)
  lse_BxT = jax.nn.logsumexp(logits, axis=-1)
  tgt_BxT = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
  return lse_BxT - tgt_BxT


def loss_fn(params, batch, model: nn.Module):
  return loss_and_load(params, batch, model)[0]


def loss_and_load(params, batch, model: nn.Module, extra=None):
  """(mean cross-entropy + the MoE balance term, assignments per layer and expert (None without experts)).
  ``extra``: model variables beside the parameters (the step's fp8 weights, framework/model.py fp8_cache)."""
  variables = {"params": params, **(extra or {})}
  if not model.cfg.moe:
    logits_BxTxV = model.apply(variables, batch["inputs"])
    return jnp.mean(cross_entropy(logits_BxTxV, batch["targets"])), None
  logits_BxTxV, moe_vars = model.apply(variables, batch["inputs"], mutable=["moe"])
  c = model.cfg
  aux = moe_lib.aux_loss(moe_vars["moe"], c.aux_loss_coef, c.n_layers, batch["inputs"].shape[0])
  load = moe_lib.layer_load(moe_vars["moe"], c.n_experts)
  return jnp.mean(cross_entropy(logits_BxTxV, batch["targets"])) + aux, load


def init_state(rng, model: nn.Module, tx: optax.GradientTransformation, seq: int = 8) -> TrainState:
  """Boxed (logically annotated) state; unbox with ``nn.unbox`` after reading shardings."""
  params = model.init(rng, jnp.zeros((1, seq), jnp.int32))["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def apply_grads(state: TrainState, grads, tx: optax.GradientTransformation) -> TrainState:
  params, opt_state = optim.apply(tx, grads, state.opt_state, state.params)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state)


def accumulate(loss_and_grads, params, batch, n: int, mean: bool = True):
  """Mean loss and gradients over ``n`` equal micro-batches taken one at a time (gradient accumulation: the
  activations of one micro-batch are live at once). Micro-batch i holds rows i, n+i, 2n+i, ... so each keeps
  every device's share of a batch sharded over its first axis. ``mean=False``: their sum (a ``loss_and_grads``
  that already normalises by the whole batch; no second gradient-sized buffer for the division). Outputs after
  the first two (e.g. the router's expert counts) are summed, never divided."""
  if n == 1:
    return loss_and_grads(params, batch)

  def split(x_BxT):
    return x_BxT.reshape(x_BxT.shape[0] // n, n, *x_BxT.shape[1:]).swapaxes(0, 1)

  def body(carry, micro):
    return jax.tree.map(jnp.add, carry, loss_and_grads(params, micro)), None

  micro = jax.tree.map(split, batch)
  # One loop over every micro-batch: the program holds one micro-batch's activations at a time. (With the
  # first micro-batch outside the loop, XLA allocated the zeroed activation stacks of both forward passes
  # together: tests/parallelism/test_grad_accum.py.) The sum starts
  # from zeros that depend on the data (0 x a token id): XLA cannot fold them into a host literal the size of
  # the gradients while compiling (tens of GB for a replicated 8B model), as it may a constant.
  token_zero = jnp.zeros((), jnp.float32) * jax.tree.leaves(batch)[0].ravel()[0].astype(jnp.float32)
  shapes = jax.eval_shape(loss_and_grads, params, jax.tree.map(lambda x: x[0], micro))
  (loss, grads, *rest), _ = jax.lax.scan(body, jax.tree.map(lambda s: _zeros(s, token_zero), shapes), micro)
  return ((loss / n, jax.tree.map(lambda g: g / n, grads)) if mean else (loss, grads)) + tuple(rest)


def _zeros(s: jax.ShapeDtypeStruct, token_zero):
  """Zeros of ``s``'s shape and dtype from the runtime scalar ``token_zero``, varying over the same mesh axes as
  ``s`` inside shard_map (its ``manual_axis_type``); from a constant where ``token_zero`` varies over more."""
  mat = getattr(s, "manual_axis_type", None)
  want = frozenset(mat.varying) if mat is not None else frozenset()
  src = token_zero if fp8._varying(token_zero) <= want else jnp.zeros((), jnp.float32)
  return fp8._vary(jnp.broadcast_to(src.astype(s.dtype), s.shape), want)


def train_step(state: TrainState, batch, *, model: nn.Module, tx: optax.GradientTransformation,
               microbatches: int = 1, grad_shardings=None):
  """``grad_shardings`` (a tree of shardings like the params, or None): where the summed gradients should live
  before the update; the jit form's ZeRO-1 passes the optimizer state's shardings, so GSPMD reduce-scatters
  the gradients onto them instead of all-reducing (parallelism/zero.py)."""
  params = optim.grad_params(state.params, state.opt_state, model.cfg.dtype)
  gdt = optim.grad_dtype(state.opt_state)
  extra = model_lib.fp8_cache(model.cfg, params)  # once per step, before the micro-batch loop

  def loss_and_grads(p, b):
    (loss, load), grads = jax.value_and_grad(loss_and_load, has_aux=True)(p, b, model, extra)
    return loss, grads if gdt is None else jax.tree.map(lambda g: g.astype(gdt), grads), load
  loss, grads, load = accumulate(loss_and_grads, params, batch, microbatches)
  if grad_shardings is not None:
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
  metrics = StepMetrics(loss=loss, grad_norm=optax.tree.norm(grads),
                        n_tokens=jnp.asarray(batch["targets"].size, jnp.int32), expert_load=load)
  return balance_router(apply_grads(state, grads, tx), load, model.cfg.router_bias_rate), metrics


def balance_router(state: TrainState, load_LxE, rate: float) -> TrainState:
  """The step's router-bias update (``model.router_bias_rate``; framework/moe.py update_bias) on the params and,
  with master weights, on their float32 masters (which the next update starts from)."""
  if not rate or load_LxE is None:
    return state
  opt = state.opt_state
  if isinstance(opt, optim.MasterState):
    opt = opt._replace(master=moe_lib.update_bias(opt.master, load_LxE, rate))
  return TrainState(step=state.step, params=moe_lib.update_bias(state.params, load_LxE, rate), opt_state=opt)


def eval_step(params, batch, *, model: nn.Module):
  return loss_fn(params, batch, model)

