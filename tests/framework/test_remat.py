"""Remat policies (framework/remat.py, ``model.remat``): each lowers and leaves the gradients unchanged, keeps
the residuals it names (compiled temporary memory), tags activations only when it reads tags, and the
offloading ones move their residuals to pinned host memory on a TPU target.

What each policy re-runs in the backward pass (remat.RECOMPUTES) is checked against the matmuls of the
real train step in tests/framework/test_flops.py.
"""
import dataclasses
import re
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from framework import model as model_lib
from framework import remat
from framework.config import REMAT_POLICIES, ModelConfig

SMALL = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)
TOKENS = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)


def _loss(model):
  return lambda p, t: jnp.mean(jax.nn.logsumexp(model.apply({"params": p}, t), axis=-1))


def _grads(cfg: ModelConfig, params):
  return jax.jit(jax.grad(_loss(model_lib.build(cfg))))(params, TOKENS)


@pytest.fixture(scope="module")
def params():
  return jax.jit(lambda: nn.unbox(model_lib.init_params(model_lib.build(SMALL), jax.random.key(0))))()


@pytest.fixture(scope="module")
def gelu_params():
  cfg = dataclasses.replace(SMALL, mlp="gelu")
  return jax.jit(lambda: nn.unbox(model_lib.init_params(model_lib.build(cfg), jax.random.key(0))))()


def test_every_config_name_has_a_policy():
  assert set(remat.RECOMPUTES) == set(REMAT_POLICIES)
  assert remat.policy("none") is None
  for name in REMAT_POLICIES[1:]:
    assert callable(remat.policy(name))


@pytest.mark.parametrize("policy", REMAT_POLICIES[1:])
def test_grads_equal_no_remat(policy, params):
  """Recomputing the forward changes which values are kept, not what they are (f32, 1e-6)."""
  want = _grads(SMALL, params)
  got = _grads(dataclasses.replace(SMALL, remat=policy), params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("policy", ["minimal", "save_dot_except_mlp", "minimal_offloaded"])
def test_grads_equal_no_remat_non_gated_blockwise(policy, gelu_params):
  """The non-gated MLP tags 'mlpwi' instead of 'mlpwi_0'/'mlpwi_1'; blockwise attention's custom VJP sits
  inside the remat."""
  cfg = dataclasses.replace(SMALL, mlp="gelu", attention="blockwise", attention_block=8)
  want = _grads(dataclasses.replace(cfg, attention="dense"), gelu_params)
  got = _grads(dataclasses.replace(cfg, remat=policy), gelu_params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_tags_only_where_a_policy_reads_them(params):
  """Named policies see every projection tagged; the others trace without any tag (so their programs are
  the ones they were before tags existed)."""
  def names(cfg):
    text = str(jax.make_jaxpr(_loss(model_lib.build(cfg)))(params, TOKENS))
    return {n for n in remat.NAMES if re.search(rf"name={n}\b", text)}
  assert names(dataclasses.replace(SMALL, remat="minimal")) == set(remat.NAMES) - {remat.MLP_IN, remat.MOE_DISPATCH,
                                                                                    remat.MOE_COMBINE}
  for policy in ("none", "full", "dots", "dots_no_batch"):
    assert names(dataclasses.replace(SMALL, remat=policy)) == set(), policy


# ---------------------------------------------------------------------------------------------- what is saved

DEEP = ModelConfig(vocab_size=256, d_model=128, n_layers=16, n_heads=4, n_kv_heads=2, d_ff=512, max_seq_len=256,
                   attention="blockwise", attention_block=64)
B, T = 2, 256


def _temp_mib(policy: str) -> float:
  cfg = dataclasses.replace(DEEP, remat=policy)
  model = model_lib.build(cfg)
  p = jax.eval_shape(lambda: nn.unbox(model_lib.init_params(model, jax.random.key(0))))
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
  compiled = jax.jit(jax.grad(_loss(model))).lower(p, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def test_saved_residuals_follow_the_policy():
  """16 layers, blockwise attention (no T x S residuals): what a policy keeps per layer and token is
  visible in the compiled temporaries. Above 'full' (the layer inputs only), each named policy adds its
  saved projections: out_proj D = 128, q/k/v (H + 2K) E = 256, both 384 f32 values per token and layer
  (measured: full 16.0, save_out_proj 20.5, save_qkv_proj 24.3, save_dot_except_mlp 28.0, minimal 57.3,
  none 90.0, dots 105.8 MiB: without remat a layer keeps what fused kernels keep (framework/layers.py rms_norm,
  swiglu), while 'dots' keeps every matmul's output)."""
  temp = {p: _temp_mib(p) for p in ("full", "save_out_proj", "save_qkv_proj", "save_dot_except_mlp", "minimal",
                                    "dots", "none")}
  order = sorted(temp, key=temp.get)
  assert order[:5] == ["full", "save_out_proj", "save_qkv_proj", "save_dot_except_mlp", "minimal"], temp
  assert min(temp["none"], temp["dots"]) > 1.3 * temp["minimal"], temp
  per_value = DEEP.n_layers * B * T * 4 / 2**20  # MiB per saved f32 value per token and layer
  H, K, E, D = DEEP.n_heads, DEEP.n_kv_heads, DEEP.hd, DEEP.d_model
  for policy, values in (("save_out_proj", D), ("save_qkv_proj", (H + 2 * K) * E),
                         ("save_dot_except_mlp", (H + 2 * K) * E + D)):
    assert temp[policy] - temp["full"] == pytest.approx(values * per_value, rel=0.15), (policy, temp)


# ---------------------------------------------------------------------------------------------- host offload

TPU = AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")


@pytest.mark.parametrize("policy, offloaded", [("qkv_proj_offloaded", 3), ("minimal_offloaded", 6),
                                                ("save_qkv_proj", 0)])
def test_offloading_policies_move_residuals_to_pinned_host_on_tpu(policy, offloaded, params):
  """XLA:CPU drops host placement (its host is its device), so the offload is checked in the program
  lowered for a TPU target: one pinned_host transfer per named residual of a layer (q, k, v; plus out,
  gate and up for minimal: the down projection's output is not needed by the backward pass at all)."""
  model = model_lib.build(dataclasses.replace(SMALL, remat=policy))
  with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("data",), abstract_device=TPU)):
    traced = jax.jit(jax.grad(_loss(model))).trace(params, TOKENS)
  text = traced.lower(lowering_platforms=("tpu",)).as_text()
  assert text.count('"pinned_host"') == offloaded


def test_offloading_without_host_memory_names_the_on_device_policy(monkeypatch):
  no_host = types.SimpleNamespace(addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
  monkeypatch.setattr(jax, "devices", lambda platform=None: [no_host])
  with pytest.raises(ValueError, match=r"remat='minimal_offloaded' offloads to pinned host memory.*use the "
                                       r"on-device policy minimal"):
    remat.check_host_offload("minimal_offloaded", "cpu")
  with pytest.raises(ValueError, match=r"on-device policy save_qkv_proj"):
    remat.check_host_offload("qkv_proj_offloaded", "cpu")
  remat.check_host_offload("minimal", "cpu")  # on-device policies need no host memory
