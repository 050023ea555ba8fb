"""Shared set-up for the layout-equivalence tests: one tiny model, one batch, one reference."""
from __future__ import annotations

import math

import jax
import numpy as np

from framework import config as config_lib
from parallelism import mesh as mesh_lib
from parallelism import step as step_lib

# Tiny on purpose (compile time dominates): GQA with 8 query / 4 kv heads so tensor=4 divides both;
# 4 layers so pipeline=4 has one layer per stage.
BASE = {
    "model": {"n_layers": 4, "d_model": 64, "n_heads": 8, "n_kv_heads": 4, "max_seq_len": 16},
    "data": {"global_batch": 8, "seq_len": 16},
    "optim": {"warmup_steps": 1},  # step 0 of the warm-up has lr 0; step 1 is a real update
    "train": {"steps": 10},
}
SCHEDULE_KEYS = ("microbatches", "schedule", "rules", "virtual_stages", "tensor_sequence_parallel")


def make_cfg(mesh: dict, form: str, model: dict | None = None, data: dict | None = None,
             optim: dict | None = None) -> config_lib.Config:
  d = {k: dict(v) for k, v in BASE.items()}
  d["mesh"] = dict(mesh, form=form)
  d["model"].update(model or {})
  d["data"].update(data or {})
  d["optim"].update(optim or {})
  n = math.prod(v for k, v in mesh.items() if k not in SCHEDULE_KEYS)
  return config_lib.validate(config_lib.from_dict(d), n)


def build(mesh: dict, form: str, model: dict | None = None, data: dict | None = None,
          optim: dict | None = None) -> step_lib.CompiledStep:
  cfg = make_cfg(mesh, form, model, data, optim)
  n = math.prod(cfg.mesh.sizes().values())
  return step_lib.build_step(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:n]))


def make_batch(cfg, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  shape = (cfg.data.global_batch, cfg.data.seq_len)
  return {"inputs": rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32),
          "targets": rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32)}


def loss_and_grads(st: step_lib.CompiledStep, state_np, batch_np):
  """(loss, grads) of the compiled step's layout, gathered to host numpy."""
  state = jax.device_put(state_np, st.state_shardings)
  batch = st.put_batch(batch_np)
  with st.context():
    loss, grads = jax.jit(st.loss_and_grads)(state.params, batch["inputs"], batch["targets"])
  return float(loss), jax.tree.map(np.asarray, grads)


def assert_trees_close(got, want, rtol, atol):
  flat_g = jax.tree_util.tree_leaves_with_path(got)
  flat_w = jax.tree.leaves(want)
  assert len(flat_g) == len(flat_w)
  for (path, g), w in zip(flat_g, flat_w):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def _in_layer_stack(path) -> bool:
  return any(getattr(k, "key", None) == "layers" for k in path)


def chunk_layers(tree, v: int):
  """A single-device tree (params, grads or a whole TrainState) in the layout of ``mesh.virtual_stages=v``: every
  leaf of the layer stack ``L x ...`` reshaped to ``v x L/v x ...`` (same layer order)."""
  if v == 1:
    return tree
  return jax.tree_util.tree_map_with_path(
      lambda p, a: a.reshape((v, a.shape[0] // v) + a.shape[1:]) if _in_layer_stack(p) else a, tree)


def unchunk_layers(tree, v: int):
  """Inverse of :func:`chunk_layers`."""
  if v == 1:
    return tree
  return jax.tree_util.tree_map_with_path(
      lambda p, a: a.reshape((-1,) + a.shape[2:]) if _in_layer_stack(p) else a, tree)
