"""The ``jit`` form: GSPMD partitions the pure step from the logical-axis rules.

The step is framework/train_step.py's ``train_step`` as it stands; only the shardings of its state and
batch (parallelism/compiled.py) tell XLA how to lay it out. The jit form with ``pipeline > 1`` is built by
parallelism/shard_map_step.py (a shard_map manual over 'pipeline' only).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from framework import model as model_lib
from framework import optim, train_step as ts
from framework.config import Config, ConfigError
from parallelism import compiled
from parallelism import rules as rules_lib


def build(cfg: Config, mesh: Mesh, donate: bool = True) -> compiled.CompiledStep:
  if cfg.mesh.form != "jit" or cfg.mesh.pipeline > 1:
    raise ConfigError("jit_step.build is for form='jit' without a pipeline; use parallelism.step.build_step")
  # 'layers' -> 'pipeline' is a no-op at size 1; dropping it keeps the rules free of an axis nobody shards.
  rules = rules_lib.without(rules_lib.get(cfg.mesh.rules), "pipeline")
  model = model_lib.build(cfg.model)
  tx = optim.make(cfg.optim, cfg.train.steps)
  zero1 = cfg.optim.shard_optimizer_state
  tx = compiled.zero_tx(model, tx, mesh, rules) if zero1 else tx
  state_sh = compiled.state_shardings(model, tx, mesh, rules, zero1)
  # mesh.microbatches without a pipeline = gradient accumulation (MaxText's gradient_accumulation_steps)
  # ZeRO-1: gradients constrained to the optimizer state's shardings (reduce-scatter; parallelism/zero.py);
  # where the state is padded, the optimizer pads them and GSPMD lays them out like the state.
  grad_sh = compiled.grad_shardings(model, state_sh, mesh, zero1, pad=False) if zero1 else None
  step = functools.partial(ts.train_step, model=model, tx=tx, microbatches=cfg.mesh.microbatches,
                           grad_shardings=grad_sh)
  gdt = jnp.float32 if cfg.optim.master_weights else None
  return compiled.assemble(cfg, mesh, model, tx, rules, state_sh, step,
                           functools.partial(_loss_and_grads, model=model, grad_dtype=gdt,
                                             microbatches=cfg.mesh.microbatches), donate)


def _loss_and_grads(params, inputs_BxT, targets_BxT, *, model, grad_dtype=None, microbatches: int = 1):
  """The pure step's loss and gradients over the whole batch (its micro-batches accumulated as the step does);
  GSPMD partitions them from the inputs' shardings."""
  def one(p, batch):
    loss, grads = jax.value_and_grad(ts.loss_fn)(p, batch, model)
    return loss, grads if grad_dtype is None else jax.tree.map(lambda g: g.astype(grad_dtype), grads)
  return ts.accumulate(one, params, {"inputs": inputs_BxT, "targets": targets_BxT}, microbatches)
