"""The compiled step both forms build: :class:`CompiledStep`, and the sharding helpers they share.

A ``CompiledStep`` runs (``step(state, batch)``), initialises a sharded state, and lowers on abstract
inputs at any mesh size without allocating (what the performance model and emulation do). Which form
built it (parallelism/jit_step.py or parallelism/shard_map_step.py) does not show in its contract: same
``TrainState``, same shardings, same donation.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from framework import train_step as ts
from framework.config import Config
from parallelism import zero

BATCH_SPEC = P(("data", "fsdp", "expert"), "sequence")


def abstract_key() -> jax.ShapeDtypeStruct:
  """The shape and dtype of an init key, without making one: a concrete key is a device computation,
  which compile-only (AOT) devices cannot run, and shapes are all that tracing the init needs."""
  return jax.eval_shape(lambda: jax.random.key(0))


class Context:
  """Mesh + logical rules active while tracing (activation constraints read them)."""

  def __init__(self, mesh: Mesh, rules: tuple):
    self.mesh, self.rules = mesh, rules
    self._stack = []

  def __enter__(self):
    for cm in (jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules)):
      cm.__enter__()
      self._stack.append(cm)
    return self

  def __exit__(self, *exc):
    while self._stack:
      self._stack.pop().__exit__(*exc)


def state_shardings(model: nn.Module, tx, mesh: Mesh, rules: tuple, shard_optimizer: bool = False) -> ts.TrainState:
  """The TrainState's shardings (a tree of NamedSharding) from the model's logical axes and ``rules``;
  ``shard_optimizer``: the optimizer state also split over the data-parallel axes (ZeRO-1, parallelism/zero.py)."""
  with Context(mesh, rules):
    boxed = jax.eval_shape(functools.partial(ts.init_state, model=model, tx=tx), abstract_key())
    sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  if shard_optimizer:
    sh = sh.replace(opt_state=zero.shard_tree(sh.opt_state, nn.unbox(boxed.opt_state), mesh))
  return sh


def _abstract_params(model: nn.Module):
  return jax.eval_shape(lambda k: model.init(k, jnp.zeros((1, 8), jnp.int32))["params"], abstract_key())


def zero_tx(model: nn.Module, tx, mesh: Mesh, rules: tuple):
  """ZeRO-1's optimizer: ``tx`` with its state in the padded shapes of parallelism/zero.py where a leaf needs
  them (``zero.padded``; ``tx`` itself when none does)."""
  with Context(mesh, rules):
    boxed = _abstract_params(model)
    sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  return zero.padded(tx, sh, nn.unbox(boxed), mesh)


def grad_shardings(model: nn.Module, state_sh: ts.TrainState, mesh: Mesh, shard_optimizer: bool,
                   pad: bool = True):
  """Where a step's summed gradients live: like the params, or (ZeRO-1) like their optimizer state, in its
  padded shapes (``pad=False``: gradients of the params' own shapes, left like the params where ZeRO-1 pads)."""
  if not shard_optimizer:
    return state_sh.params
  return zero.shard_tree(state_sh.params, nn.unbox(_abstract_params(model)), mesh, pad)


@dataclasses.dataclass
class CompiledStep:
  cfg: Config
  mesh: Mesh
  model: nn.Module  # auto-mode model (full shapes): init, eval, sampling
  tx: Any
  rules: tuple
  state_shardings: Any  # TrainState of NamedSharding
  batch_shardings: Any  # {'inputs','targets'} -> NamedSharding
  step_fn: Callable  # jitted (state, batch) -> (state, metrics)
  init_fn: Callable  # jitted rng -> state (sharded)
  # The step's (params, inputs, targets) -> (loss, grads), not jitted: for tests and the performance model,
  # called under jit in the mesh context (``with st.context(): jax.jit(st.loss_and_grads)(...)``). ``params``
  # are the ones the step differentiates (``framework.optim.grad_params``); the whole batch's loss and gradients,
  # its ``mesh.microbatches`` accumulated as the step does; the shard_map form with ZeRO-1 returns the gradients
  # reduce-scattered (sharded like the optimizer state).
  loss_and_grads: Callable

  @functools.cached_property
  def eval_fn(self) -> Callable:
    """Jitted mean loss on sharded params (same shardings as training)."""
    fn = functools.partial(ts.eval_step, model=self.model)
    return jax.jit(fn, in_shardings=(self.state_shardings.params, self.batch_shardings),
                   out_shardings=NamedSharding(self.mesh, P()))

  def init_state(self, rng) -> ts.TrainState:
    with self.context():
      return self.init_fn(rng)

  def abstract_state(self) -> ts.TrainState:
    with self.context():
      shapes = jax.eval_shape(self.init_fn, abstract_key())
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                        self.state_shardings)

  def abstract_batch(self) -> dict:
    d = self.cfg.data
    return {k: jax.ShapeDtypeStruct((d.global_batch, d.seq_len), jnp.int32, sharding=s)
            for k, s in self.batch_shardings.items()}

  def context(self) -> Context:
    return Context(self.mesh, self.rules)

  def __call__(self, state, batch):
    with self.context():
      return self.step_fn(state, batch)

  def lower(self, state=None, batch=None):
    """Lowers on abstract inputs by default (no allocation at any scale)."""
    with self.context():
      return self.step_fn.lower(state if state is not None else self.abstract_state(),
                                batch if batch is not None else self.abstract_batch())

  def local_rows(self) -> slice:
    """The global-batch rows this process's devices hold (contiguous for meshes built by make_mesh).
    Not always B/P: when the batch axes do not span the processes, every process needs them all."""
    return local_rows(self.batch_shardings, self.cfg.data.global_batch, self.cfg.data.seq_len)

  def put_batch(self, batch_local: dict) -> dict:
    """Host numpy rows of this process (``local_rows()``) -> global sharded arrays."""
    return put_batch(self.batch_shardings, batch_local, self.cfg.data.global_batch)


@dataclasses.dataclass
class Executables:
  """Compiled ``(state, batch) -> (state, metrics)`` executables of one step (e.g. loaded from disk, or a donating
  and a non-donating variant) behind ``CompiledStep``'s ``put_batch`` and call, so the training loop runs them as
  it runs a ``CompiledStep``; ``use`` names the one the next call runs."""
  runs: dict  # name -> executable
  batch_shardings: dict  # {'inputs','targets'} -> NamedSharding
  global_batch: int
  use: str = "run"

  def put_batch(self, batch_local: dict) -> dict:
    return put_batch(self.batch_shardings, batch_local, self.global_batch)

  def __call__(self, state, batch):
    return self.runs[self.use](state, batch)


def local_rows(batch_shardings: dict, global_batch: int, seq_len: int) -> slice:
  """The rows of a ``global_batch`` x ``seq_len`` batch laid out by ``batch_shardings`` that this process holds."""
  idx = batch_shardings["inputs"].addressable_devices_indices_map((global_batch, seq_len))
  starts = [(i[0].start or 0) for i in idx.values()]
  stops = [(global_batch if i[0].stop is None else i[0].stop) for i in idx.values()]
  rows = slice(min(starts), max(stops))
  covered = sum(b - a for a, b in sorted(set(zip(starts, stops))))
  if covered != rows.stop - rows.start:
    raise ValueError(f"process {jax.process_index()} holds non-contiguous batch rows {sorted(set(zip(starts, stops)))}")
  return rows


def put_batch(batch_shardings: dict, batch_local: dict, global_batch: int) -> dict:
  """This process's host rows {'inputs', 'targets'} -> global arrays laid out by ``batch_shardings``: what
  every step of the project takes, whether a ``CompiledStep`` or an executable loaded from disk runs it."""
  out = {}
  for k, v in batch_local.items():
    sh = batch_shardings[k]
    if jax.process_count() == 1:
      out[k] = jax.device_put(v, sh)
    else:
      out[k] = jax.make_array_from_process_local_data(sh, v, (global_batch,) + v.shape[1:])
  return out


def assemble(cfg: Config, mesh: Mesh, model: nn.Module, tx, rules: tuple, state_sh, step: Callable,
             loss_and_grads: Callable, donate: bool) -> CompiledStep:
  """The one place where shardings and donation are applied to a (state, batch) -> (state, metrics) step."""
  batch_sh = {k: NamedSharding(mesh, BATCH_SPEC) for k in ("inputs", "targets")}

  def init(rng):
    return nn.unbox(ts.init_state(rng, model, tx))

  init_fn = jax.jit(init, out_shardings=state_sh)
  # Donating the state lets XLA update parameters and optimizer moments in place: peak memory holds one
  # copy of the state, not two.
  step_fn = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, NamedSharding(mesh, P())),
                    donate_argnums=(0,) if donate else ())
  return CompiledStep(cfg=cfg, mesh=mesh, model=model, tx=tx, rules=rules, state_shardings=state_sh,
                      batch_shardings=batch_sh, step_fn=step_fn, init_fn=init_fn, loss_and_grads=loss_and_grads)
