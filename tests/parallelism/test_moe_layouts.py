"""Mixture of experts: every layout equals one device (loss with its balance term, gradients, router statistics).

A tiny MoE (8 experts, top-2, a shared expert) on 8 emulated CPU devices: expert parallelism alone and with data
/ FSDP / tensor (with and without Megatron sequence parallelism) / sequence / pipeline axes, in the shard_map
form (two ``all_to_all`` per layer) and the jit form (sharding rules). Tolerances as tests/parallelism/
test_layouts.py (1e-5 of the loss, 1e-5 of each leaf's largest entry). Router statistics: assignments per layer
and expert in the step's batch (``StepMetrics.expert_load``), which must be exact counts.
"""
import jax
import jax.extend.core as jex_core
import numpy as np
import pytest

from framework import moe
from framework.config import ConfigError
from tests.parallelism import harness

REL = 1e-5
MOE = {"n_experts": 8, "experts_per_token": 2, "moe_d_ff": 32, "n_shared_experts": 1, "aux_loss_coef": 0.1}


@pytest.fixture(scope="module")
def moe_reference():
  st = harness.build({}, "jit", model=MOE)
  state = jax.tree.map(np.asarray, st.init_state(jax.random.key(1)))
  batch = harness.make_batch(st.cfg, seed=3)
  loss, grads = harness.loss_and_grads(st, state, batch)
  with st.context():
    _, metrics = st.step_fn(jax.device_put(state, st.state_shardings), st.put_batch(batch))
  return {"state": state, "batch": batch, "loss": loss, "grads": grads,
          "load": np.asarray(metrics.expert_load), "metrics_loss": float(metrics.loss)}


def _check(st, ref):
  loss, grads = harness.loss_and_grads(st, harness.chunk_layers(ref["state"], st.cfg.mesh.virtual_stages), ref["batch"])
  grads = harness.unchunk_layers(grads, st.cfg.mesh.virtual_stages)
  assert abs(loss - ref["loss"]) <= REL * abs(ref["loss"]), (loss, ref["loss"])
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref["grads"])):
    np.testing.assert_allclose(g, w, rtol=REL, atol=REL * float(np.max(np.abs(w))), err_msg=jax.tree_util.keystr(path))
  state = jax.device_put(harness.chunk_layers(ref["state"], st.cfg.mesh.virtual_stages), st.state_shardings)
  with st.context():
    _, metrics = st.step_fn(state, st.put_batch(ref["batch"]))
  np.testing.assert_array_equal(np.asarray(metrics.expert_load), ref["load"])
  assert abs(float(metrics.loss) - ref["metrics_loss"]) <= REL * abs(ref["metrics_loss"])


LAYOUTS = [
    ({"expert": 8}, "shard_map"),
    ({"data": 2, "expert": 4}, "shard_map"),
    ({"fsdp": 2, "expert": 2, "tensor": 2}, "shard_map"),
    ({"expert": 2, "tensor": 4, "tensor_sequence_parallel": True}, "shard_map"),
    ({"expert": 4, "sequence": 2}, "shard_map"),
    ({"data": 2, "expert": 2, "microbatches": 2}, "shard_map"),
    ({"expert": 4, "data": 2}, "jit"),
    ({"pipeline": 2, "expert": 2, "tensor": 2, "microbatches": 4, "schedule": "1f1b"}, "shard_map"),
    ({"pipeline": 2, "expert": 4, "microbatches": 2, "schedule": "1f1b", "virtual_stages": 2}, "shard_map"),
    ({"pipeline": 2, "expert": 2, "microbatches": 2}, "jit"),
]


@pytest.mark.parametrize("mesh,form", LAYOUTS, ids=["-".join(f"{k}{v}" for k, v in m.items()) + "-" + f
                                                    for m, f in LAYOUTS])
def test_moe_layout_equals_one_device(moe_reference, mesh, form):
  _check(harness.build(mesh, form, model=MOE), moe_reference)


def test_router_statistics_count_every_assignment(moe_reference):
  load = moe_reference["load"]
  tokens = harness.BASE["data"]["global_batch"] * harness.BASE["data"]["seq_len"]
  assert load.shape == (harness.BASE["model"]["n_layers"], MOE["n_experts"])
  np.testing.assert_array_equal(load.sum(axis=1), tokens * MOE["experts_per_token"])
  assert (load > 0).sum() > load.size // 2  # random routing spreads assignments


def test_balance_term_is_in_the_loss(moe_reference):
  """The same state without the balance term gives a smaller loss (the term is positive: E/k x sum f P >= ...),
  so the term is really added."""
  st = harness.build({}, "jit", model=dict(MOE, aux_loss_coef=0.0))
  loss, _ = harness.loss_and_grads(st, moe_reference["state"], moe_reference["batch"])
  # sum_e f_e P_e >= 1/E per layer and sequence (f and P are distributions): the term is at least coef / k
  assert moe_reference["loss"] - loss >= 0.1 / MOE["experts_per_token"] * 0.99


def _collective_names(jaxpr, out=None):
  out = set() if out is None else out
  for e in jaxpr.eqns:
    out.add(e.primitive.name)
    for sub in jex_core.jaxprs_in_params(e.params):
      _collective_names(sub, out)
  return out


def test_expert_parallel_step_exchanges_tokens_by_all_to_all(moe_reference):
  st = harness.build({"expert": 4, "data": 2}, "shard_map", model=MOE)
  state = jax.device_put(moe_reference["state"], st.state_shardings)
  with st.context():
    names = _collective_names(jax.make_jaxpr(st.step_fn)(state, st.put_batch(moe_reference["batch"])).jaxpr)
  assert "all_to_all" in names


def test_capacity_path_drops_and_counts():
  """With a capacity factor below what the routing needs, some assignments are dropped and counted; with a large
  one none are and the output equals the dropless path's."""
  import jax.numpy as jnp

  from framework import moe
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 16, 16)), jnp.float32)
  logits = jnp.asarray(rng.normal(size=(64, 4)) + np.array([3.0, 0, 0, 0]), jnp.float32)  # expert 0 is popular
  gate, ids, _ = moe.route(logits, 2, "softmax", True)
  dense = moe.dropless(x, ids, gate, lambda xs, sizes: jax.lax.ragged_dot(xs, w, sizes), 4)
  full, dropped = moe.capacity(x, ids, gate, lambda xb: jnp.einsum("ecd,edf->ecf", xb, w), 4, 4.0)
  assert float(dropped) == 0
  np.testing.assert_allclose(full, dense, rtol=1e-5, atol=1e-5)
  _, dropped = moe.capacity(x, ids, gate, lambda xb: jnp.einsum("ecd,edf->ecf", xb, w), 4, 1.0)
  counts = np.bincount(np.asarray(ids).reshape(-1), minlength=4)
  assert float(dropped) == np.maximum(counts - moe.capacity_of(128, 4, 1.0), 0).sum() > 0


def test_expert_axis_needs_divisible_experts():
  with pytest.raises(ConfigError, match="n_experts=8 is not divisible by mesh.expert=3"):
    harness.make_cfg({"expert": 3}, "shard_map", model=MOE, data={"global_batch": 9})
  with pytest.raises(ConfigError, match="model.n_experts=0"):
    harness.make_cfg({"expert": 2}, "shard_map")


def test_imbalance_is_the_busiest_rank_over_the_mean():
  balanced = np.full((3, 8), 10.0)
  assert moe.imbalance(balanced, 4) == pytest.approx(1.0)
  skew = np.array([[40.0, 0, 0, 0, 0, 0, 0, 0]])  # every assignment on expert 0
  assert moe.imbalance(skew, 4) == pytest.approx(4.0)  # rank 0 (experts 0-1) holds all 40 of a mean 10
  assert moe.imbalance(skew, 1) == pytest.approx(1.0)  # one rank: nothing to wait for
  two = np.array([[30.0, 10, 10, 10, 10, 10, 10, 10], [10.0] * 8])  # layer 0: rank 0 has 40 of mean 25
  assert moe.imbalance(two, 4) == pytest.approx((40 / 25 + 1.0) / 2)
  with pytest.raises(ValueError, match="divisible"):
    moe.imbalance(balanced, 3)


BIASED = dict(MOE, router_bias_rate=0.05)


def _three_steps(st, state, batch):
  """Losses and router counts of three steps from ``state`` (the bias moves after each), and the final biases."""
  out = []
  state = jax.device_put(harness.chunk_layers(state, st.cfg.mesh.virtual_stages), st.state_shardings)
  with st.context():
    for _ in range(3):
      state, m = st.step_fn(state, st.put_batch(batch))
      out.append((float(m.loss), np.asarray(m.expert_load)))
  bias = [np.asarray(x).reshape(-1, MOE["n_experts"]) for p, x in jax.tree_util.tree_leaves_with_path(
      harness.unchunk_layers(jax.device_get(state.params), st.cfg.mesh.virtual_stages)) if "router_bias" in str(p)]
  return out, np.concatenate(bias)


@pytest.fixture(scope="module")
def biased_reference(moe_reference):
  st = harness.build({}, "jit", model=BIASED)
  state = jax.tree.map(np.asarray, st.init_state(jax.random.key(1)))
  return state, _three_steps(st, state, moe_reference["batch"])


def test_router_bias_moves_toward_balance(biased_reference):
  """DeepSeek-V3's auxiliary-loss-free balancing: after a step every layer's bias is +rate on the experts below
  the layer's mean load and -rate above it; the selection follows the bias (counts change), the weights do not
  (the bias gets no gradient)."""
  state, (steps, bias) = biased_reference
  load0 = steps[0][1]
  assert not any("router_bias" in str(p) for p, _ in jax.tree_util.tree_leaves_with_path(
      harness.build({}, "jit", model=MOE).init_state(jax.random.key(1)).params))  # off by default
  first = 0.05 * np.sign(load0.mean(axis=1, keepdims=True) - load0)
  later = sum(0.05 * np.sign(s[1].mean(axis=1, keepdims=True) - s[1]) for s in steps[1:])
  np.testing.assert_allclose(bias, first + later, atol=1e-6)
  assert not np.array_equal(steps[0][1], steps[2][1])  # the selection moved with the bias


@pytest.mark.parametrize("mesh,form", [({"data": 2, "expert": 4}, "shard_map"),
                                       ({"pipeline": 2, "expert": 4, "microbatches": 2, "schedule": "1f1b",
                                         "virtual_stages": 2}, "shard_map"),
                                       ({"expert": 4, "data": 2}, "jit")],
                         ids=["data2-expert4", "pipeline2-virtual2-expert4", "jit-expert4-data2"])
def test_router_bias_equals_one_device(biased_reference, moe_reference, mesh, form):
  state, (ref_steps, ref_bias) = biased_reference
  steps, bias = _three_steps(harness.build(mesh, form, model=BIASED), state, moe_reference["batch"])
  for (loss, load), (rloss, rload) in zip(steps, ref_steps):
    assert abs(loss - rloss) <= 1e-4 * abs(rloss)
    np.testing.assert_array_equal(load, rload)
  np.testing.assert_allclose(bias, ref_bias, atol=1e-6)


def _count(jaxpr, name):
  n = sum(e.primitive.name == name for e in jaxpr.eqns)
  return n + sum(_count(sub, name) for e in jaxpr.eqns for sub in jex_core.jaxprs_in_params(e.params))


@pytest.mark.parametrize("impl", ["dropless", "capacity"])
def test_remat_minimal_keeps_the_exchanged_tokens(moe_reference, impl):
  """Under 'minimal' the backward pass keeps the tokens a rank received and the experts' outputs it got back:
  4 token all_to_all per layer (2 forward, 2 backward) where 'full' exchanges the tokens again (6); the result is
  the one-device step's."""
  def a2a(remat):
    st = harness.build({"expert": 4, "data": 2}, "shard_map", model=dict(MOE, remat=remat, moe_impl=impl,
                                                                         capacity_factor=8.0))
    state = jax.device_put(moe_reference["state"], st.state_shardings)
    with st.context():
      jaxpr = jax.make_jaxpr(st.step_fn)(state, st.put_batch(moe_reference["batch"])).jaxpr
    return st, _count(jaxpr, "all_to_all")
  st, minimal = a2a("minimal")
  _, full = a2a("full")
  # dropless also sends each token's expert id forward (ints, no gradient; recomputed for the backward's sort)
  assert (minimal, full) == ((6, 8) if impl == "dropless" else (4, 6))
  _check(st, moe_reference)


def _a2a_bytes(jaxpr):
  n = sum(v.aval.size * v.aval.dtype.itemsize for e in jaxpr.eqns if e.primitive.name == "all_to_all"
          for v in e.invars)
  return n + sum(_a2a_bytes(sub) for e in jaxpr.eqns for sub in jex_core.jaxprs_in_params(e.params))


@pytest.mark.parametrize("impl", ["dropless", "capacity"])
def test_sequence_parallel_tensor_ranks_dispatch_only_their_chunk(moe_reference, impl):
  """Under Megatron sequence parallelism each tensor rank routes and dispatches its own chunk of the sequence
  (the experts' tensor ranks gather what they received): the expert-parallel all_to_all moves half the bytes it
  moves when both tensor ranks send the whole sequence, and the step equals one device."""
  def build(sp):
    st = harness.build({"expert": 2, "tensor": 2, "data": 2, "tensor_sequence_parallel": sp}, "shard_map",
                       model=dict(MOE, moe_impl=impl, capacity_factor=8.0))
    state = jax.device_put(moe_reference["state"], st.state_shardings)
    with st.context():
      jaxpr = jax.make_jaxpr(st.step_fn)(state, st.put_batch(moe_reference["batch"])).jaxpr
    return st, _a2a_bytes(jaxpr)
  st, chunked = build(True)
  _, whole = build(False)
  assert whole > 0 and chunked * 2 == whole
  _check(st, moe_reference)
