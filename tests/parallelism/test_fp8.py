"""fp8 projection matmuls (``model.matmul_precision='fp8'``, framework/fp8.py) across layouts and for GPU targets.

* Every layout equals the one-device fp8 run at the tolerances of test_layouts.py (rtol 1e-5): each operand is
  scaled by the amax of the whole tensor (GSPMD's reduction under jit, an explicit ``pmax`` in shard_map), so
  all layouts quantize the same values with the same scales and differ only in float32 summation order.
  Pipelines scale per micro-batch (a stage only ever sees one micro-batch), so their reference is the
  one-device fp8 run on the same micro-batches, averaged: rows ``[i*mb, (i+1)*mb)`` of every data shard's block in
  the shard_map form, of the global batch in the jit form (whose shard_map is manual over 'pipeline' only).
* fp8 stays close to float32: an e4m3 operand is within 2^-4 of itself, so one dot of two of them is within
  2 x 2^-4 + 2^-8 < 2^-3 of the exact product; the logits are held to 2^-3 relative (measured: about 2^-4).
  The e5m2 gradient operand adds its 2^-3: gradients are held to 2^-2 relative (measured: about 2^-3). The loss
  moves by at most twice the mean over tokens of the largest logit change (cross-entropy is 2-Lipschitz in the
  max norm), and it does move (fp8 is really on).
* Compiled for 8 H100s (compile-only CUDA), the program's dots take f8e4m3fn x f8e4m3fn operands forward and
  f8e5m2 x f8e4m3fn backward.
"""
import dataclasses
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework import model as model_lib
from framework import train_step as ts
from tests.parallelism import harness

TOL = {"rtol": 1e-5, "atol": 1e-6}
FP8 = {"matmul_precision": "fp8"}
HAS_CUDA = importlib.util.find_spec("jax_plugins") is not None and \
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
S = pytest.mark.slow

LAYOUTS = [
    ({"data": 2, "tensor": 4}, "jit"),
    ({"data": 2, "tensor": 4}, "shard_map"),
    ({"fsdp": 4, "tensor": 2}, "shard_map"),
    ({"data": 4, "sequence": 2}, "shard_map"),
    pytest.param({"fsdp": 2, "sequence": 2, "tensor": 2}, "shard_map", marks=S),
    pytest.param({"fsdp": 4, "tensor": 2}, "jit", marks=S),
    pytest.param({"data": 4, "sequence": 2}, "jit", marks=S),
    pytest.param({"data": 8}, "shard_map", marks=S),
    pytest.param({"fsdp": 8, "rules": "zero3"}, "shard_map", marks=S),
]
PIPELINES = [
    ({"pipeline": 2, "data": 4, "microbatches": 2, "schedule": "1f1b"}, "shard_map"),
    ({"pipeline": 2, "data": 4, "microbatches": 2, "schedule": "1f1b"}, "jit"),
    pytest.param({"pipeline": 2, "tensor": 4, "microbatches": 2, "schedule": "gpipe"}, "shard_map", marks=S),
    pytest.param({"pipeline": 4, "tensor": 2, "microbatches": 4, "schedule": "1f1b"}, "shard_map", marks=S),
]


def _id(v):
  return "x".join(f"{k}{x}" for k, x in v.items()) if isinstance(v, dict) else v


@pytest.fixture(scope="module")
def fp8_reference(reference):
  st = harness.build({}, "jit", FP8)
  loss, grads = harness.loss_and_grads(st, reference["state"], reference["batch"])
  return {"loss": loss, "grads": grads}


def _assert_close(loss, grads, want_loss, want_grads):
  assert abs(loss - want_loss) <= TOL["atol"] + TOL["rtol"] * abs(want_loss)
  harness.assert_trees_close(grads, want_grads, **TOL)


@pytest.mark.parametrize("mesh,form", LAYOUTS, ids=_id)
def test_fp8_layout_matches_single_device(reference, fp8_reference, mesh, form):
  loss, grads = harness.loss_and_grads(harness.build(mesh, form, FP8), reference["state"], reference["batch"])
  _assert_close(loss, grads, fp8_reference["loss"], fp8_reference["grads"])


def _micro_batch_reference(state, batch, n_micro: int, blocks: int):
  """Mean loss and gradients of one-device fp8 runs, one per pipeline micro-batch (its rows as the pipeline
  takes them)."""
  rows_total = batch["inputs"].shape[0]
  block = rows_total // blocks
  mb = block // n_micro
  losses, grads = [], []
  for i in range(n_micro):
    rows = np.concatenate([np.arange(j * block + i * mb, j * block + (i + 1) * mb) for j in range(blocks)])
    st = harness.build({}, "jit", FP8, {"global_batch": len(rows)})
    loss, g = harness.loss_and_grads(st, state, {k: v[rows] for k, v in batch.items()})
    losses.append(loss)
    grads.append(g)
  return float(np.mean(losses)), jax.tree.map(lambda *g: np.mean(g, axis=0), *grads)


@pytest.mark.parametrize("mesh,form", PIPELINES, ids=_id)
def test_fp8_pipeline_matches_single_device_on_its_micro_batches(reference, mesh, form):
  st = harness.build(mesh, form, FP8)
  loss, grads = harness.loss_and_grads(st, reference["state"], reference["batch"])
  blocks = mesh.get("data", 1) if form == "shard_map" else 1
  want_loss, want_grads = _micro_batch_reference(reference["state"], reference["batch"], mesh["microbatches"],
                                                 blocks)
  _assert_close(loss, grads, want_loss, want_grads)


def test_fp8_is_close_to_float32(reference):
  cfg = harness.make_cfg({}, "jit")
  m32 = model_lib.build(cfg.model)
  m8 = model_lib.build(dataclasses.replace(cfg.model, **FP8))
  params, batch = reference["state"].params, reference["batch"]
  z32 = jax.jit(m32.apply)({"params": params}, batch["inputs"])
  z8 = jax.jit(m8.apply)({"params": params}, batch["inputs"])
  assert float(jnp.linalg.norm(z8 - z32) / jnp.linalg.norm(z32)) <= 2.0 ** -3
  l8, g8 = jax.jit(jax.value_and_grad(lambda p, b: ts.loss_fn(p, b, m8)))(params, batch)
  l32, g32 = reference["loss"], reference["grads"]
  assert 0 < abs(float(l8) - l32) <= 2 * float(jnp.mean(jnp.max(jnp.abs(z8 - z32), axis=-1)))
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g32)):
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) <= 2.0 ** -2


@pytest.mark.skipif(not HAS_CUDA, reason='the tpu-aot extra is not installed (pip install -e ".[tpu-aot]")')
@pytest.mark.parametrize("form", ["jit", pytest.param("shard_map", marks=S)])
def test_fp8_dots_in_the_h100_program(form):
  from parallelism import step as step_lib
  from parallelism import targets
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    cfg = harness.make_cfg({"data": 2, "tensor": 4}, form, dict(FP8, dtype="bfloat16"))
    st = step_lib.build_step(cfg, targets.target_mesh(cfg.mesh, "h100"))
    hlo = st.lower().compile().as_text()
  finally:
    jax.config.update("jax_disable_most_optimizations", old)
  types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
  operands = {(types.get(a), types.get(b)) for a, b in re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)}
  assert ("f8e4m3fn", "f8e4m3fn") in operands  # forward
  assert {("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")} & operands  # backward: e5m2 gradient x e4m3 operand
  assert ("bf16", "bf16") in operands  # attention's products stay in the compute dtype


def _reduce_max_operands(jaxpr, in_loop=False):
  """(operand shape, inside a loop?) of every reduce_max in a jaxpr and its sub-jaxprs (scan, while, cond,
  shard_map, custom_vjp, remat)."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "reduce_max":
      out.append((tuple(eqn.invars[0].aval.shape), in_loop))
    inner_loop = in_loop or eqn.primitive.name in ("scan", "while")
    for v in eqn.params.values():
      for j in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(j, "jaxpr", j)
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          out += _reduce_max_operands(inner, inner_loop)
  return out


@pytest.mark.parametrize("mesh", [{"data": 2, "tensor": 4, "microbatches": 2},
                                  {"pipeline": 2, "tensor": 2, "microbatches": 2, "schedule": "1f1b"}], ids=_id)
def test_fp8_weights_are_quantized_once_per_step(mesh):
  """The projection weights' amax is taken once, over the whole (stage's) layer stack, before the micro-batch loop
  or the pipeline ticks: no loop (micro-batches, ticks, the layer scan) takes the amax of one layer's weight."""
  st = harness.build(mesh, "shard_map", FP8)
  state, batch = st.abstract_state(), st.abstract_batch()
  with st.context():
    closed = jax.make_jaxpr(st.loss_and_grads)(state.params, batch["inputs"], batch["targets"])
  found = _reduce_max_operands(closed.jaxpr)
  stacks, layers = set(), set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
    name = path[-1].key
    if name in model_lib.FP8_CACHED:
      local = st.state_shardings.params
      for k in path:
        local = local[k.key]
      shape = local.shard_shape(leaf.shape)
      stacks.add(shape)
      layers.add(shape[len(shape) - len(model_lib.PARAM_AXES[name]):])
  assert {s for s, loop in found if not loop} & stacks  # the step's one amax per stacked weight
  assert not {s for s, loop in found if loop} & layers  # and none per layer in a loop

