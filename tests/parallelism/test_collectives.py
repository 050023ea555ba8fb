"""The shard_map step's jaxpr contains the explicit collectives each layout calls for."""
import collections

import jax
import pytest

from tests.parallelism import harness


def _primitives(jaxpr, acc):
  for eqn in jaxpr.eqns:
    acc[eqn.primitive.name] += 1
    for v in eqn.params.values():
      for x in v if isinstance(v, (list, tuple)) else (v,):
        inner = getattr(x, "jaxpr", x)
        if hasattr(inner, "eqns"):
          _primitives(inner, acc)
  return acc


def collectives(mesh):
  st = harness.build(mesh, "shard_map")
  state, batch = st.abstract_state(), st.abstract_batch()
  with st.context():
    jaxpr = jax.make_jaxpr(st.loss_and_grads)(state.params, batch["inputs"], batch["targets"])
  return _primitives(jaxpr.jaxpr, collections.Counter())


# Primitive names as jax 0.10 spells them: psum of a varying value is 'psum_invariant', psum_scatter
# is 'reduce_scatter'.
@pytest.mark.parametrize("mesh,present,absent", [
    # DP gradient all-reduce + Megatron TP psum + vocab-parallel cross-entropy (pmax); nothing gathered.
    ({"data": 2, "tensor": 4}, ("psum_invariant", "pmax"), ("all_gather", "reduce_scatter", "ppermute")),
    # FSDP: weights all-gathered before use, gradients reduce-scattered (the gather's transpose).
    ({"fsdp": 4, "tensor": 2}, ("all_gather", "reduce_scatter", "psum_invariant", "pmax"), ("ppermute",)),
    # Sequence parallelism: K/V all-gathered along the sequence, no TP collectives.
    ({"data": 4, "sequence": 2}, ("all_gather", "psum_invariant"), ("pmax", "ppermute")),
    # Pipeline: activations and cotangents move by ppermute.
    ({"pipeline": 2, "data": 4, "microbatches": 2, "schedule": "1f1b"}, ("ppermute", "psum_invariant"), ("pmax",)),
], ids=["data2xtensor4", "fsdp4xtensor2", "data4xsequence2", "pipeline2xdata4"])
def test_explicit_collectives_in_jaxpr(mesh, present, absent):
  prims = collectives(mesh)
  for p in present:
    assert prims[p] > 0, f"{p} missing; collectives: {sorted(k for k in prims if 'p' in k)}"
  for p in absent:
    assert prims[p] == 0, f"unexpected {p} x{prims[p]}"


def test_fsdp_gathers_every_sharded_weight_once_per_use():
  # 9 weights of a layer/the model are FSDP-sharded on 'embed' (wq wk wv wo w_gate w_up w_down,
  # embedding, lm_head); each is gathered once in the forward and reduce-scattered once in the backward.
  prims = collectives({"fsdp": 8})
  assert prims["all_gather"] == prims["reduce_scatter"] == 9


@pytest.mark.parametrize("mesh,form,needle", [
    ({"fsdp": 4, "tensor": 2}, "shard_map", "all_gather"),
    ({"pipeline": 2, "tensor": 4, "microbatches": 2, "schedule": "gpipe"}, "shard_map", "collective_permute"),
    ({"pipeline": 2, "data": 4, "microbatches": 2, "schedule": "1f1b"}, "jit", "collective_permute"),
], ids=["shard_map-fsdp4xtensor2", "shard_map-pipeline2xtensor4", "jit-pipeline2xdata4"])
def test_lower_on_abstract_inputs(mesh, form, needle):
  # What the performance model does: lower the whole train step (optimizer included) without allocating.
  text = harness.build(mesh, form).lower().as_text()
  assert needle in text
