"""Gradient accumulation (``mesh.microbatches`` without a pipeline) gives the full batch's loss and gradients.

The micro-batches are taken one at a time (a scan in the compiled step), each holding every device's share of
the batch; the mean of their losses and gradients equals the single-device full-batch values up to float
reassociation (same tolerances as tests/parallelism/test_layouts.py: 1e-5 of the loss, 1e-5 of each leaf's
largest entry; an error of 1e-4 of one leaf fails them: tests/parallelism/test_layouts_optimized.py).
"""
import jax
import numpy as np
import optax
import pytest

from framework import train_step as ts
from tests.parallelism import harness

REL = 1e-5


@pytest.mark.parametrize("mesh,form", [({"data": 2, "microbatches": 4}, "jit"),
                                       ({"fsdp": 2, "tensor": 2, "microbatches": 2}, "shard_map")],
                         ids=["data2xmb4-jit", "fsdp2xtensor2xmb2-shard_map"])
def test_accumulated_step_equals_the_full_batch(reference, mesh, form):
  st = harness.build(mesh, form)
  n = st.cfg.mesh.microbatches
  state = jax.device_put(reference["state"], st.state_shardings)
  batch = st.put_batch(reference["batch"])

  def accumulated(params, b):
    return ts.accumulate(lambda p, x: st.loss_and_grads(p, x["inputs"], x["targets"]), params, b, n)

  with st.context():
    loss, grads = jax.jit(accumulated)(state.params, batch)
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

