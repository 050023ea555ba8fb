"""Fixtures of the parallelism tests. tests/conftest.py already gives 8 emulated CPU devices."""
import jax
import numpy as np
import pytest

from tests.parallelism import harness


@pytest.fixture(scope="package", autouse=True)
def _fast_compiles():
  """XLA's backend optimisation dominates these tests' time: both the reference and the sharded layouts
  compile without it (test_layouts_optimized.py covers one case per axis and form with it on). Restored
  afterwards (other packages)."""
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture(scope="package")
def reference():
  """Single-device state, batch, loss and gradients of the tiny model."""
  st = harness.build({}, "jit")
  state = jax.tree.map(np.asarray, st.init_state(jax.random.key(0)))
  batch = harness.make_batch(st.cfg)
  loss, grads = harness.loss_and_grads(st, state, batch)
  return {"step": st, "state": state, "batch": batch, "loss": loss, "grads": grads}
