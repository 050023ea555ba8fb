"""Gradient accumulation (``mesh.microbatches`` without a pipeline) gives the full batch's loss and gradients.

The micro-batches are taken one at a time (a scan in the compiled step), each holding every device's share of
the batch; the mean of their losses and gradients equals the single-device full-batch values up to float
reassociation (same tolerances as tests/parallelism/test_layouts.py: 1e-5 of the loss, 1e-5 of each leaf's
largest entry; an error of 1e-4 of one leaf fails them: tests/parallelism/test_layouts_optimized.py).
"""
import jax
import jax.extend.core as jex_core
import numpy as np
import optax
import pytest

from tests.parallelism import harness

REL = 1e-5


@pytest.mark.parametrize("mesh,form", [({"data": 2, "microbatches": 4}, "jit"),
                                       ({"fsdp": 2, "tensor": 2, "microbatches": 2}, "shard_map")],
                         ids=["data2xmb4-jit", "fsdp2xtensor2xmb2-shard_map"])
def test_accumulated_step_equals_the_full_batch(reference, mesh, form):
  st = harness.build(mesh, form)
  state = jax.device_put(reference["state"], st.state_shardings)
  batch = st.put_batch(reference["batch"])
  with st.context():
    loss, grads = jax.jit(st.loss_and_grads)(state.params, batch["inputs"], batch["targets"])
    hlo = st.step_fn.lower(state, batch).as_text()
    _, metrics = st.step_fn(state, batch)
  # the per-micro-batch loss is normalised by the micro-batch's tokens in both forms
  assert abs(float(loss) - reference["loss"]) <= REL * abs(reference["loss"])
  grads = jax.tree.map(np.asarray, grads)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(reference["grads"])):
    np.testing.assert_allclose(g, w, rtol=REL, atol=REL * float(np.max(np.abs(w))))
  # the compiled step accumulates (a loop over the micro-batches) and reports the full batch's values
  assert "while" in hlo
  assert abs(float(metrics.loss) - reference["loss"]) <= REL * abs(reference["loss"])
  want_norm = float(optax.tree.norm(reference["grads"]))
  assert abs(float(metrics.grad_norm) - want_norm) <= 1e-4 * want_norm



def _collectives(jaxpr, in_loop=False, out=None):
  """(primitive name, inside a scan / while) for every collective of ``jaxpr`` and its sub-jaxprs."""
  out = [] if out is None else out
  for e in jaxpr.eqns:
    name = e.primitive.name
    if name in ("psum", "psum_invariant", "reduce_scatter", "all_gather", "all_to_all", "ppermute"):
      out.append((name, in_loop))
    loop = in_loop or name in ("scan", "while")
    for sub in jex_core.jaxprs_in_params(e.params):
      _collectives(sub, loop, out)
  return out


@pytest.mark.parametrize("zero1", [True, False], ids=["zero1", "allreduce"])
def test_shard_map_accumulation_reduces_gradients_once(reference, zero1):
  """Data-parallel gradients are summed locally over the micro-batches and reduced once, after the last one
  (Megatron's grad buffer, DDP's no_sync): no collective runs inside the accumulation loop of a data-parallel
  layout, and the step still equals the full batch."""
  st = harness.build({"data": 2, "microbatches": 4}, "shard_map", optim={"shard_optimizer_state": zero1})
  state = jax.device_put(reference["state"], st.state_shardings)
  batch = st.put_batch(reference["batch"])
  with st.context():
    step_jaxpr = jax.make_jaxpr(st.step_fn)(state, batch).jaxpr
    loss, grads = jax.jit(st.loss_and_grads)(state.params, batch["inputs"], batch["targets"])
  colls = _collectives(step_jaxpr)
  assert not [c for c in colls if c[1]], colls
  assert {n for n, _ in colls} & ({"reduce_scatter"} if zero1 else {"psum", "psum_invariant"}), colls
  assert abs(float(loss) - reference["loss"]) <= REL * abs(reference["loss"])
  for g, w in zip(jax.tree.leaves(jax.tree.map(np.asarray, grads)), jax.tree.leaves(reference["grads"])):
    np.testing.assert_allclose(g, w, rtol=REL, atol=REL * float(np.max(np.abs(w))))


@pytest.mark.parametrize("form", ["jit", "shard_map"])
def test_accumulation_holds_one_micro_batch_of_activations(form):
  """Two micro-batches of 8 x 256 tokens need no more working memory than one batch of that size (the compiled
  step's temp bytes, within 10%): the program holds one micro-batch's activation stacks at a time. A first
  micro-batch taken outside the loop gave XLA two forward passes whose zeroed stacks it allocated together
  (1.75x the temp bytes in the jit form)."""
  model = {"n_layers": 4, "d_model": 256, "n_heads": 8, "n_kv_heads": 4, "max_seq_len": 256}
  temp = {}
  for n in (1, 2):
    st = harness.build({"data": 1, "microbatches": n}, form, model, data={"global_batch": 8 * n, "seq_len": 256})
    temp[n] = st.lower().compile().memory_analysis().temp_size_in_bytes
  assert temp[2] <= 1.1 * temp[1], temp
