"""A full optimizer step (AdamW, clipping, schedule) in the explicit forms equals the single-device step."""
import jax
import numpy as np
import pytest

from tests.parallelism import harness

# Two steps: the warm-up makes step 0's learning rate 0, so step 1 is the first real update. Adam's
# first updates are ~lr * sign(g), so gradient round-off is not amplified much; 1e-5 is still tight
# against updates of size lr = 3e-3.
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _two_steps(st, state_np, batches):
  state = jax.device_put(state_np, st.state_shardings)
  losses = []
  for b in batches:
    state, metrics = st(state, st.put_batch(b))
    losses.append(float(metrics.loss))
  return jax.tree.map(np.asarray, state), losses, float(metrics.grad_norm)


@pytest.mark.parametrize("mesh,form", [
    ({"data": 2, "tensor": 4}, "shard_map"),
    pytest.param({"pipeline": 2, "fsdp": 2, "tensor": 2, "microbatches": 2, "schedule": "1f1b"}, "shard_map",
                 marks=pytest.mark.slow),
    pytest.param({"pipeline": 2, "data": 4, "microbatches": 2, "schedule": "gpipe"}, "jit", marks=pytest.mark.slow),
], ids=["shard_map-data2xtensor4", "shard_map-pipeline2xfsdp2xtensor2-1f1b", "jit-pipeline2xdata4-gpipe"])
def test_optimizer_steps_match_single_device(reference, mesh, form):
  ref = reference["step"]
  batches = [harness.make_batch(ref.cfg, seed=s) for s in (0, 1)]
  want_state, want_losses, want_norm = _two_steps(ref, reference["state"], batches)
  got_state, got_losses, got_norm = _two_steps(harness.build(mesh, form), reference["state"], batches)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got_norm, want_norm, rtol=1e-5)
  assert int(got_state.step) == int(want_state.step) == 2
  harness.assert_trees_close(got_state.params, want_state.params, **TOL)
  harness.assert_trees_close(got_state.opt_state, want_state.opt_state, **TOL)
  # The update really moved the parameters (a no-op step would pass the checks above trivially).
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), want_state.params, reference["state"].params)
  assert max(jax.tree.leaves(moved)) > 1e-3
