"""Layouts give the single-device loss and gradients with XLA's optimisations on, as in production.

The rest of this package compiles with ``jax_disable_most_optimizations`` (XLA's backend optimisation
level 0 and LLVM's expensive passes off: they dominate compile time). This module compiles as production
does, for one case per axis and form, so an equivalence that holds only in the less optimised program
still fails CI.

Tolerance: optimised code reorders float32 sums (fusions, split reductions, different all-reduce
association), so it may differ from the single-device program by rounding, never by more. Measured over
these cases: the loss within 1 float32 ulp (4.8e-7 on a loss of 5.57), every gradient entry within 7.1e-7
of its leaf's largest entry. The checks allow 1e-5 of the loss and 1e-5 of each leaf's largest entry,
over 10x that; a layout bug (a reduction missed or done twice, a wrong shard) is off by a sizeable
fraction of the gradient itself, and an error of 1e-4 of one leaf already fails (the last test).
"""
import jax
import numpy as np
import pytest

from tests.parallelism import harness

LOSS_RTOL = 1e-5
GRAD_REL_TO_LEAF_MAX = 1e-5
PIPELINE_1F1B = {"pipeline": 4, "microbatches": 4, "schedule": "1f1b"}
LAYOUTS = [{"data": 4}, {"fsdp": 4}, {"tensor": 4}, {"sequence": 4}, PIPELINE_1F1B]


@pytest.fixture(scope="module", autouse=True)
def _optimised():
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture(scope="module")
def optimised_reference(_optimised):
  st = harness.build({}, "jit")
  state = jax.tree.map(np.asarray, st.init_state(jax.random.key(0)))
  batch = harness.make_batch(st.cfg)
  loss, grads = harness.loss_and_grads(st, state, batch)
  return {"state": state, "batch": batch, "loss": loss, "grads": grads}


def assert_grads_close(got, want):
  flat_g = jax.tree_util.tree_leaves_with_path(got)
  flat_w = jax.tree.leaves(want)
  assert len(flat_g) == len(flat_w)
  for (path, g), w in zip(flat_g, flat_w):
    atol = GRAD_REL_TO_LEAF_MAX * float(np.max(np.abs(w)))
    np.testing.assert_allclose(g, w, rtol=GRAD_REL_TO_LEAF_MAX, atol=atol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mesh", LAYOUTS, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
@pytest.mark.parametrize("form", ["jit", "shard_map"])
def test_optimised_layout_matches_single_device(optimised_reference, mesh, form):
  assert not jax.config.values["jax_disable_most_optimizations"]
  ref = optimised_reference
  st = harness.build(mesh, form)
  loss, grads = harness.loss_and_grads(st, ref["state"], ref["batch"])
  assert abs(loss - ref["loss"]) <= LOSS_RTOL * abs(ref["loss"]), (loss, ref["loss"])
  assert_grads_close(grads, ref["grads"])


def test_the_check_catches_an_error_of_1e_4_of_one_leaf(optimised_reference):
  want = optimised_reference["grads"]
  leaves, treedef = jax.tree.flatten(want)
  i = int(np.argmax([np.max(np.abs(x)) for x in leaves]))
  off = list(leaves)
  off[i] = leaves[i] + 1e-4 * np.max(np.abs(leaves[i])) * np.sign(leaves[i])
  with pytest.raises(AssertionError):
    assert_grads_close(jax.tree.unflatten(treedef, off), want)
