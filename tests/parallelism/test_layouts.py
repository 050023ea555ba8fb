"""Every layout, in both forms, gives the single-device loss and gradients (float32, tight)."""
import pytest

from tests.parallelism import harness

LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}

NON_PIPELINE = [
    {"data": 8},
    {"fsdp": 8},
    {"tensor": 4},
    {"sequence": 8},
    {"data": 2, "tensor": 4},
    {"fsdp": 4, "tensor": 2},
    {"data": 4, "sequence": 2},
    {"data": 2, "fsdp": 2, "tensor": 2},
    {"fsdp": 2, "sequence": 2, "tensor": 2},
    {"data": 4, "fsdp": 2, "rules": "zero3"},
]
PIPELINE = [
    {"pipeline": 2, "microbatches": 4},
    {"pipeline": 2, "data": 4, "microbatches": 2},
    {"pipeline": 2, "tensor": 4, "microbatches": 2},
    {"pipeline": 4, "tensor": 2, "microbatches": 4},
    {"pipeline": 2, "data": 2, "tensor": 2, "microbatches": 2},
    {"pipeline": 2, "fsdp": 2, "sequence": 2, "microbatches": 2},
]
# The jit form runs the pipeline as a shard_map manual over 'pipeline' only, which XLA supports
# with at most one other axis of size > 1 (see parallelism/shard_map_step.check).
JIT_PIPELINE = [m for m in PIPELINE if sum(1 for k, v in m.items() if k not in harness.SCHEDULE_KEYS) <= 2]


def _ids(layouts):
  return ["x".join(f"{k}{v}" for k, v in m.items()) for m in layouts]


def _check(reference, mesh, form, model=None):
  st = harness.build(mesh, form, model)
  loss, grads = harness.loss_and_grads(st, reference["state"], reference["batch"])
  assert abs(loss - reference["loss"]) <= LOSS_TOL["atol"] + LOSS_TOL["rtol"] * abs(reference["loss"])
  harness.assert_trees_close(grads, reference["grads"], **GRAD_TOL)


@pytest.mark.parametrize("mesh", NON_PIPELINE, ids=_ids(NON_PIPELINE))
@pytest.mark.parametrize("form", ["jit", "shard_map"])
def test_layout_matches_single_device(reference, mesh, form):
  _check(reference, mesh, form)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mesh", PIPELINE, ids=_ids(PIPELINE))
def test_pipeline_shard_map_matches_single_device(reference, mesh, schedule):
  _check(reference, dict(mesh, schedule=schedule), "shard_map")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mesh", JIT_PIPELINE, ids=_ids(JIT_PIPELINE))
def test_pipeline_jit_matches_single_device(reference, mesh, schedule):
  _check(reference, dict(mesh, schedule=schedule), "jit")
