"""The pipeline's stash (parallelism/stash.py): a vjp split across ticks gives jax.vjp's gradients, and only the
residuals that depend on the micro-batch are stashed (never the weights, whatever model.remat says)."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from framework import model as model_lib
from framework.config import MeshConfig, ModelConfig
from parallelism import manual, mesh as mesh_lib, rules as rules_lib, stash


def _gathered_scan(w_DxD, x_BxD):
  """FSDP-like: a weight gathered over 'fsdp' and cast, then used by every step of a scan."""
  w = jax.lax.all_gather(w_DxD, "fsdp", axis=0, tiled=True).astype(jnp.bfloat16)

  def body(c, wl):
    return jnp.tanh(c @ wl.astype(jnp.float32)), None
  y, _ = jax.lax.scan(body, manual.vary(x_BxD, ("fsdp",)), jnp.stack([w, 2 * w]))
  return y


def test_split_vjp_gives_the_vjp_and_stashes_activations_only():
  mesh = mesh_lib.make_mesh(MeshConfig(pipeline=2, fsdp=4), jax.devices()[:8])
  seen = {}

  def body(w, x):
    split = stash.SplitVjp(_gathered_scan, w, x)
    seen.setdefault("avals", [(a.shape, a.dtype) for a in split.stash_avals])
    y, res = split.forward(w, x)
    dy = jnp.cos(y)  # any cotangent
    dw, dx = split.backward(w, res, dy)
    y2, pullback = jax.vjp(_gathered_scan, w, x)
    dw2, dx2 = pullback(dy)
    return y - y2, dw - dw2, dx - dx2, dw2

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P("pipeline")),
                     out_specs=(P("pipeline", "fsdp"), P("fsdp"), P("pipeline", "fsdp"), P("fsdp")),
                     axis_names=frozenset({"pipeline", "fsdp"}))
  rng = np.random.default_rng(0)
  w, x = rng.normal(size=(8, 8)).astype(np.float32) * 0.3, rng.normal(size=(4, 8)).astype(np.float32)
  dy_, dw_, dx_, dw_ref = jax.jit(fn)(w, x)
  assert np.abs(np.asarray(dw_ref)).max() > 1e-3
  assert np.abs(np.asarray(dy_)).max() == np.abs(np.asarray(dw_)).max() == np.abs(np.asarray(dx_)).max() == 0.0
  # the stacked gathered weights (2 x 8 x 8) are recomputed, not stashed: only batch-shaped residuals remain
  assert seen["avals"] and all(shape[-2:] == (2, 8) for shape, _ in seen["avals"]), seen["avals"]


def _stage_stash_bytes(remat: str, rows: int, mesh_sizes: dict, dtype="bfloat16") -> int:
  """Bytes one unit stashes for a pipeline stage of the manual-mode model (traced, not compiled)."""
  cfg = ModelConfig(n_layers=4, d_model=64, n_heads=8, n_kv_heads=4, max_seq_len=16, remat=remat, dtype=dtype)
  mesh = mesh_lib.make_mesh(MeshConfig(**mesh_sizes), jax.devices()[:math.prod(mesh_sizes.values())])
  rules = rules_lib.get("default")
  model = model_lib.build(cfg, manual.manual_ctx(mesh, rules))
  with nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(lambda: model_lib.init_params(model_lib.build(cfg), jax.random.key(0)))
  specs = jax.tree.map(lambda s: manual.strip_trivial(s, mesh), nn.logical_to_mesh(nn.get_partition_spec(boxed), rules),
                       is_leaf=lambda s: isinstance(s, P))
  layer_specs = specs["layers"]
  out = {}

  def body(layers, x):
    # as the pipeline does: device-local parameters, an activation varying over the batch axes
    batch_axes = manual.active(("data", "fsdp"), mesh)
    layers = manual.localize_params(layers, layer_specs, batch_axes + ("pipeline",))
    x = manual.vary(x, batch_axes)
    pos = manual.positions(x.shape[:2], 1)

    def blocks(prm, x_in):
      return model.apply({"params": {"layers": prm}}, x_in, pos, method="blocks")[0]
    out["bytes"] = stash.SplitVjp(blocks, layers, x).stash_bytes()
    return jnp.zeros((), jnp.int32)

  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nn.unbox(boxed["layers"]))
  x = jax.ShapeDtypeStruct((rows * mesh.shape["pipeline"], 16, 64), jnp.dtype(dtype))
  fn = jax.shard_map(body, mesh=mesh, in_specs=(layer_specs, P("pipeline")), out_specs=P())
  jax.make_jaxpr(fn)(shapes, x)
  return out["bytes"]


@pytest.mark.parametrize("remat", ["none", "full", "minimal"])
def test_stash_grows_with_the_micro_batch_not_with_the_weights(remat):
  # fsdp x tensor: weights are gathered and cast (bf16 compute, f32 parameters) inside the stage; a stashed
  # weight would not double with the rows of the micro-batch.
  sizes = {"pipeline": 2, "fsdp": 2, "tensor": 2}
  one, two = _stage_stash_bytes(remat, 1, sizes), _stage_stash_bytes(remat, 2, sizes)
  assert one > 0 and two == 2 * one


def test_full_remat_stashes_one_input_per_layer():
  # remat=full: the backward keeps each layer's input only: (L/P) x rows x T x D in bf16 (+ nothing else)
  sizes = {"pipeline": 2}
  layers_here, rows, t, d = 2, 1, 16, 64
  assert _stage_stash_bytes("full", rows, sizes) == layers_here * rows * t * d * 2
  assert _stage_stash_bytes("none", rows, sizes) > 4 * _stage_stash_bytes("full", rows, sizes)

