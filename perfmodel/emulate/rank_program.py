"""One rank's real program at the target scale, run on one local device.

The program is the core's per-rank trace (:func:`perfmodel.program.rank_program`: the ``shard_map`` step's
per-device body on an ``AbstractMesh`` of the target sizes, 8192 ranks being just a shape); this module adds the
rank space it lives in and :func:`rank_step`, which turns the body plus the optimizer update on this rank's shards
into a single-device function with stand-in collectives (perfmodel/emulate/standins.py). Where an N-device compile
*is* possible (N <= 1024 on this host), the emulator still uses it for the byte-exact peak memory of the real
program (perfmodel/emulate/emulator.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from framework import train_step as ts
from framework.config import Config
from perfmodel import program
from perfmodel.emulate import standins
from perfmodel.emulate.topology import RankSpace


@dataclasses.dataclass
class RankProgram(program.RankProgram):
  """The core's rank program and the space of ranks it runs in."""
  space: RankSpace = None


def build(cfg: Config) -> RankProgram:
  """Traces the per-device body of ``cfg``'s shard_map step at ``cfg.mesh`` (a validated config)."""
  core = program.rank_program(cfg)
  fields = {f.name: getattr(core, f.name) for f in dataclasses.fields(core)}
  return RankProgram(**fields, space=RankSpace.of(cfg.mesh.sizes()))


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
