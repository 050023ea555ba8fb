"""Attention kernels (framework/attention.py, ``model.attention``): every kind equals dense attention, in the
kernel alone (GQA, sequence-parallel positions, ragged block counts, f32 and bf16), in the model (logits and
gradients), in the jit and shard_map forms of the parallel step; blockwise really holds less memory; the
TPU kernel is chosen by the target's platform.

Tolerances: float32 kernels differ from dense only by summation order (measured <= 1e-6 relative), so
f32 checks use rtol 2e-5 / atol 2e-6. bfloat16 rounds the probabilities before PV in both kernels, in
different places (dense: after normalising, blockwise: before), so bf16 checks compare to the f32 result
at bf16 resolution (atol 2e-2 on unit-scale values). The negative control below shows a one-position mask
error is far outside both.
"""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from framework import attention
from framework import model as model_lib
from framework.config import MESH_AXES, ModelConfig

F32 = {"rtol": 2e-5, "atol": 2e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-2}


def _qkv(B, T, S, H, K, E, dtype, seed=0):
  kq, kk, kv, kg = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (B, T, H, E), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, E), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, E), jnp.float32).astype(dtype)
  do = jax.random.normal(kg, (B, T, H, E), jnp.float32).astype(dtype)
  return q, k, v, do


def _value_and_vjp(fn, q, k, v, do):
  """Output and input cotangents of ``fn`` for cotangent ``do``, as one compiled program."""
  def run(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))
  return jax.jit(run)(q, k, v, do)


def _assert_close(got, want, tol):
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=name, **tol)


def _positions(B, T, S, offset):
  """Queries are the slice [offset, offset + T) of S keys: what one device of a sequence-parallel layout
  sees after the K/V all-gather."""
  qpos = jnp.broadcast_to(jnp.arange(offset, offset + T, dtype=jnp.int32), (B, T))
  kpos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  return qpos, kpos


CASES = {  # (B, T, S, H, K, E, query offset, block)
    "gqa_aligned": (2, 64, 64, 8, 2, 16, 0, 16),
    "mha_one_block": (1, 32, 32, 4, 4, 8, 0, 64),
    "mqa_blocks_do_not_divide": (2, 48, 48, 6, 1, 8, 0, 20),
    "sequence_parallel_slice": (2, 16, 64, 4, 2, 8, 32, 16),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blockwise_equals_dense(case, dtype):
  B, T, S, H, K, E, offset, block = CASES[case]
  q, k, v, do = _qkv(B, T, S, H, K, E, dtype)
  qpos, kpos = _positions(B, T, S, offset)
  got = _value_and_vjp(lambda *a: attention.blockwise(*a, qpos, kpos, block), q, k, v, do)
  if dtype == "float32":
    want = _value_and_vjp(lambda *a: attention.dense(*a, qpos, kpos), q, k, v, do)
    _assert_close(got, want, F32)
  else:
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want = _value_and_vjp(lambda *a: attention.dense(*a, qpos, kpos), *f32)
    _assert_close(got, want, BF16)
    assert all(x.dtype == jnp.bfloat16 for x in got)


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dot_product_equals_dense(aligned, dtype):
  B, T, S, H, K, E, offset, _ = CASES["gqa_aligned" if aligned else "sequence_parallel_slice"]
  q, k, v, do = _qkv(B, T, S, H, K, E, dtype)
  qpos, kpos = _positions(B, T, S, offset)
  got = _value_and_vjp(lambda *a: attention.dot_product(*a, qpos, kpos, aligned=aligned), q, k, v, do)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want = _value_and_vjp(lambda *a: attention.dense(*a, qpos, kpos), *f32)
  _assert_close(got, want, F32 if dtype == "float32" else BF16)


def test_splash_kernel_equals_dense_in_the_pallas_interpreter(monkeypatch):
  """The TPU kernel's numerics off-TPU: Pallas interprets it. T = 256 with 128-blocks, so the causal
  structure spans blocks."""
  monkeypatch.setattr(attention, "SPLASH_INTERPRET", True)
  B, T, H, K, E = 1, 256, 4, 2, 16
  q, k, v, do = _qkv(B, T, T, H, K, E, "float32")
  qpos, kpos = _positions(B, T, T, 0)
  got = _value_and_vjp(lambda *a: attention.splash(*a, block=128), q, k, v, do)
  want = _value_and_vjp(lambda *a: attention.dense(*a, qpos, kpos), q, k, v, do)
  _assert_close(got, want, F32)


def test_an_off_by_one_mask_fails_the_comparison(monkeypatch):
  """Negative control: blockwise with a strict mask (a query cannot see itself) fails even the loose bf16
  tolerance."""
  def strict(q, k, qpos, kpos):
    s = jnp.einsum("bkgte,bcke->bkgtc", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
    return s, (kpos[:, None, :] < qpos[:, :, None])[:, None, None]
  monkeypatch.setattr(attention, "_scores", strict)
  B, T, S, H, K, E, offset, block = CASES["gqa_aligned"]
  q, k, v, do = _qkv(B, T, S, H, K, E, "float32")
  qpos, kpos = _positions(B, T, S, offset)
  got = _value_and_vjp(lambda *a: attention.blockwise(*a, qpos, kpos, block), q, k, v, do)
  want = _value_and_vjp(lambda *a: attention.dense(*a, qpos, kpos), q, k, v, do)
  with pytest.raises(AssertionError):
    _assert_close(got, want, BF16)


# ---------------------------------------------------------------------------------------------- in the model

BASE = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=256,
                   attention_block=32)
MODEL_VARIANTS = {
    "gqa": {},
    "head_dim_wide_tied_gelu": dict(head_dim=32, tie_embeddings=True, mlp="gelu"),
    "relu_unscanned_remat": dict(mlp="relu", scan_layers=False, remat="minimal"),
}


def _init(model):
  return jax.jit(lambda: nn.unbox(model_lib.init_params(model, jax.random.key(0))))()


def _logits_and_grads(cfg: ModelConfig, tokens, params):
  model = model_lib.build(cfg)

  def loss(p):
    logits = model.apply({"params": p}, tokens)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0]), logits
  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return logits, grads


_DENSE = {}


def _dense_reference(variant: str, T: int):
  """(config, tokens, params, dense logits and grads) per variant and length, computed once: parameters do
  not depend on the attention kind."""
  if (variant, T) not in _DENSE:
    cfg = dataclasses.replace(BASE, **MODEL_VARIANTS[variant])
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, cfg.vocab_size)
    params = _init(model_lib.build(cfg))
    _DENSE[variant, T] = (cfg, tokens, params, _logits_and_grads(cfg, tokens, params))
  return _DENSE[variant, T]


def _assert_model_close(got, want, tol):
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=jax.tree_util.keystr(path),
                               **tol)


@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
@pytest.mark.parametrize("kind", ["blockwise", "dot_product", "splash"])
def test_model_logits_and_grads_equal_dense(kind, variant, monkeypatch):
  monkeypatch.setattr(attention, "SPLASH_INTERPRET", True)
  # splash tiles by 128: two query blocks; blockwise: four key blocks of 16
  T, block = (256, 128) if kind == "splash" else (64, 16)
  cfg, tokens, params, want = _dense_reference(variant, T)
  got = _logits_and_grads(dataclasses.replace(cfg, attention=kind, attention_block=block), tokens, params)
  # the kernels' f32 reassociation (~1e-6), carried through two layers, the head and their gradients
  _assert_model_close(got, want, {"rtol": 1e-4, "atol": 1e-5})


def test_model_bf16_blockwise_matches_dense():
  cfg, tokens, params, _ = _dense_reference("gqa", 64)
  cfg = dataclasses.replace(cfg, dtype="bfloat16", param_dtype="float32", attention_block=16)
  want_logits, want_grads = _logits_and_grads(cfg, tokens, params)
  got_logits, got_grads = _logits_and_grads(dataclasses.replace(cfg, attention="blockwise"), tokens, params)
  # Logits are O(1) after the final norm: bf16 resolution there is ~1e-2. Gradients are ~1e-3..1e-2 per
  # entry; compared relative to each leaf's largest entry.
  np.testing.assert_allclose(got_logits, want_logits, atol=5e-2)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert g.dtype == jnp.float32  # f32 master weights keep f32 gradients
    assert float(jnp.max(jnp.abs(g - w))) <= 5e-2 * float(jnp.max(jnp.abs(w))) + 1e-6


def test_sampling_runs_with_every_kind():
  """KV-cached decoding attends new tokens to the cache with dense attention whatever the kind, so the
  greedy continuation of a non-dense model is the dense model's."""
  from framework import sampling
  cfg = dataclasses.replace(BASE, attention="blockwise", attention_block=16)
  params = _init(model_lib.build(cfg))
  prompt = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
  outs = [np.asarray(sampling.generate(params, prompt, jax.random.key(0), model=model_lib.build(c), max_new=8))
          for c in (cfg, dataclasses.replace(cfg, attention="dense"))]
  np.testing.assert_array_equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------- memory

def _grad_temp_bytes(cfg: ModelConfig, T: int) -> int:
  model = model_lib.build(cfg)
  params = jax.eval_shape(lambda: nn.unbox(model_lib.init_params(model, jax.random.key(0))))
  tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
  grad = jax.jit(jax.grad(lambda p, t: jnp.mean(model.apply({"params": p}, t))))
  return grad.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_backward_does_not_hold_the_score_matrix():
  """One layer at T = 2048, 8 heads: dense holds T x S f32 scores per head (8 x 2048^2 x 4 B = 128 MiB,
  several times over through softmax and its gradient); blockwise holds a few T x block buffers (8 MiB
  each at block 128). Measured on XLA:CPU: dense 519 MiB, blockwise 78 MiB of temporaries."""
  T = 2048
  cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=1, n_heads=8, n_kv_heads=2, d_ff=512, max_seq_len=T,
                    attention_block=128)
  scores = cfg.n_heads * T * T * 4
  dense = _grad_temp_bytes(cfg, T)
  blockwise = _grad_temp_bytes(dataclasses.replace(cfg, attention="blockwise"), T)
  assert dense > 2 * scores, dense / 2**20
  assert blockwise < scores, blockwise / 2**20
  assert blockwise < dense / 5, (blockwise / 2**20, dense / 2**20)


# ---------------------------------------------------------------------------------------------- platforms

TPU = AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")


def _splash_grad_trace(mesh_sizes, device):
  from parallelism import rules as rules_lib  # the logical-axis rules the jit form runs under
  cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=128, d_ff=512,
                    max_seq_len=256, attention="splash", attention_block=128, dtype="bfloat16")
  model = model_lib.build(cfg)
  params = jax.eval_shape(lambda: nn.unbox(model_lib.init_params(model, jax.random.key(0))))
  tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32)
  mesh = AbstractMesh(mesh_sizes, MESH_AXES, abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(rules_lib.get("default")):
    return jax.jit(jax.grad(lambda p, t: jnp.mean(model.apply({"params": p}, t).astype(jnp.float32)))).trace(
        params, tokens)


@pytest.mark.parametrize("mesh_sizes", [(1, 1, 1, 1, 1, 1), (1, 2, 1, 1, 1, 4)], ids=["one_chip", "data2_tensor4"])
def test_splash_lowers_for_a_tpu_target_from_this_host(mesh_sizes):
  """The kernel choice follows the mesh's platform, not jax.default_backend(): under a TPU mesh the Mosaic
  kernels (forward, dq, dkv) lower, inside a shard_map over the batch/head axes."""
  text = _splash_grad_trace(mesh_sizes, TPU).lower(lowering_platforms=("tpu",)).as_text()
  assert text.count("tpu_custom_call") >= 3


def test_splash_and_cudnn_refuse_other_platforms_with_the_alternative():
  cpu = AbstractDevice(device_kind="cpu", num_cores=None, platform="cpu")
  with pytest.raises(ValueError, match=r"splash' is a TPU kernel, this program is for 'cpu': use .*'blockwise'"):
    _splash_grad_trace((1, 1, 1, 1, 1, 1), cpu)
  q, k, v, _ = _qkv(1, 8, 8, 2, 1, 8, "bfloat16")
  qpos, kpos = _positions(1, 8, 8, 0)
  with pytest.raises(ValueError, match=r"'cudnn' needs a GPU, this program is for 'cpu': use .*'dot_product'"):
    attention.attend("cudnn", q, k, v, qpos, kpos, block=8, aligned=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_ring_blocks_match_the_xla_blocks(causal):
  """The GPU ring's block kernels (framework/ring_cudnn.py): cuDNN's output and log-sum-exp, and its backward
  from a given output and log-sum-exp (here another block's merged with this one, as in the ring), equal the XLA
  reference blocks the CPU tests run the ring with."""
  from framework import ring_cudnn  # noqa: PLC0415
  rng = np.random.default_rng(0)
  B, T, S, H, K, E = 2, 256, 256, 8, 2, 128
  q, k, v, k2, v2, do = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
                         for s in [(B, T, H, E), (B, S, K, E), (B, S, K, E), (B, S, K, E), (B, S, K, E), (B, T, H, E)])
  cf, cb = ring_cudnn.cudnn_blocks()
  xf, xb = ring_cudnn.xla_blocks()
  (co, cl), (xo, xl) = jax.jit(cf, static_argnums=3)(q, k, v, causal), jax.jit(xf, static_argnums=3)(q, k, v, causal)
  np.testing.assert_allclose(np.asarray(co, np.float32), np.asarray(xo, np.float32), atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(cl), np.asarray(xl), atol=2e-2, rtol=1e-3)
  o2, l2 = xf(q, k2, v2, False)
  o, lse = ring_cudnn.merge(xo, xl, o2, l2)
  o = o.astype(jnp.bfloat16)
  got = jax.jit(cb, static_argnums=6)(q, k, v, o, lse, do, causal)
  want = jax.jit(xb, static_argnums=6)(q, k, v, o, lse, do, causal)
  for g, w in zip(got, want):
    w = np.asarray(w, np.float32)
    np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=3e-2 * np.abs(w).max(), rtol=3e-2)
