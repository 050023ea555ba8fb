"""Building and lowering a step does no device work, so it works for devices that can only compile.

Compile-only (AOT) devices, such as a TPU topology described on a host without TPUs, fail on any eager
computation or transfer. CPU has no compile-only topology, so the check here is that building, lowering
and compiling the step moves no data to or from any device (``jax.transfer_guard("disallow")``): an eager
computation (a concrete init key, say) would have to put its inputs on a device first.
"""
import jax
import pytest

from parallelism import mesh as mesh_lib
from parallelism import step as step_lib
from tests.parallelism import harness


@pytest.mark.parametrize("mesh,form", [
    ({"data": 2, "tensor": 4}, "jit"),
    ({"pipeline": 2, "tensor": 4, "microbatches": 2, "schedule": "1f1b"}, "shard_map"),
], ids=["jit-data2xtensor4", "shard_map-pipeline2xtensor4"])
def test_build_lower_compile_move_no_data(mesh, form):
  cfg = harness.make_cfg(mesh, form)
  with jax.transfer_guard("disallow"):
    st = step_lib.build_step(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:8]))
    state = st.abstract_state()
    compiled = st.lower().compile()
  assert jax.tree.leaves(state)[0].sharding is not None
  assert compiled.memory_analysis().argument_size_in_bytes > 0


def test_guard_catches_an_eager_key():
  # The check above means something only if an eager key trips the guard.
  with jax.transfer_guard("disallow"), pytest.raises(Exception, match="Disallowed"):
    jax.random.key(0)
