"""Compiled memory of the two schedules: GPipe's stash grows with the micro-batch count, 1F1B's does not.

Fixed micro-batch size (2 rows per data replica), growing number of micro-batches M; P = 4 stages, so
1F1B needs min(M, 2P-1) = 7 stash slots once M >= 7. Compile-only (no allocation of the step). And what a slot
reads of the layer stack: one layer at a time, never a chunk-sized copy."""
import jax
import pytest

from tests.parallelism import harness

P, ROWS = 4, 2


def _temp_bytes(schedule, m):
  mesh = {"pipeline": P, "data": 2, "microbatches": m, "schedule": schedule}
  st = harness.build(mesh, "shard_map", {"d_model": 128, "max_seq_len": 64},
                     {"global_batch": 2 * ROWS * m, "seq_len": 64})
  state, batch = st.abstract_state(), st.abstract_batch()
  with st.context():
    compiled = jax.jit(st.loss_and_grads).lower(state.params, batch["inputs"], batch["targets"]).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_1f1b_stash_is_bounded_gpipe_grows():
  stash_per_micro = ROWS * 64 * 128 * 4  # at least one micro-batch's stage input (float32) per stashed unit
  g16, g32 = _temp_bytes("gpipe", 16), _temp_bytes("gpipe", 32)
  f16, f32 = _temp_bytes("1f1b", 16), _temp_bytes("1f1b", 32)
  assert f32 == f16  # 7 slots either way
  assert g32 - g16 >= 16 * stash_per_micro  # 16 more stashed units
  assert f32 < g32


def _slices_in_slots(jaxpr, in_slot=False):
  """(operand shape, slice sizes) of every dynamic_slice inside a conditional (a pipeline slot's branch) of a jaxpr
  and its sub-jaxprs (scan, cond, shard_map)."""
  out = []
  for eqn in jaxpr.eqns:
    if in_slot and eqn.primitive.name == "dynamic_slice":
      out.append((tuple(eqn.invars[0].aval.shape), tuple(eqn.params["slice_sizes"])))
    inner_slot = in_slot or eqn.primitive.name == "cond"
    for v in eqn.params.values():
      for j in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(j, "jaxpr", j)
        if hasattr(inner, "eqns"):
          out += _slices_in_slots(inner, inner_slot)
  return out


def test_a_slot_reads_one_layer_at_a_time_from_the_stack():
  """With v chunks of L/(vP) > 1 layers per stage, a slot slices one layer out of the stage's [v, L/(vP), ...]
  stack where it uses it, never a whole chunk (a chunk-sized slice feeding the layer scan is materialized by XLA:
  a copy of the chunk's weights in both slots of every tick). The shard_map form, whose slots are conditionals."""
  v, lc = 2, 2
  mesh = {"pipeline": 2, "microbatches": 4, "virtual_stages": v, "schedule": "1f1b"}
  st = harness.build(mesh, "shard_map", {"n_layers": 2 * v * lc, "d_model": 64, "max_seq_len": 32},
                     {"global_batch": 8, "seq_len": 32})
  state, batch = st.abstract_state(), st.abstract_batch()
  with st.context():
    closed = jax.make_jaxpr(st.loss_and_grads)(state.params, batch["inputs"], batch["targets"])
  stack = [(shape, sizes) for shape, sizes in _slices_in_slots(closed.jaxpr) if shape[:2] == (v, lc)]
  assert stack, "no slice of the [v, L/(vP), ...] layer stack in the slots"
  chunk_sized = [(shape, sizes) for shape, sizes in stack if sizes[1] == lc]
  assert not chunk_sized, f"whole-chunk slices of the layer stack: {chunk_sized[:3]}"
  assert all(sizes[:2] == (1, 1) for _, sizes in stack)
