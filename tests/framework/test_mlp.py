"""MLP kinds and head widths (``model.mlp``, ``model.head_dim``): parameter trees and counts, the MLP's
function against a hand computation, and widths where heads x head_dim != d_model."""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework import flops
from framework import model as model_lib
from framework.config import ModelConfig

BASE = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=32)


def _params(cfg: ModelConfig):
  return jax.eval_shape(lambda: nn.unbox(model_lib.init_params(model_lib.build(cfg), jax.random.key(0))))


VARIANTS = {
    "swiglu": {},
    "gelu_tied": dict(mlp="gelu", tie_embeddings=True),
    "relu_head_dim_32_mqa": dict(mlp="relu", head_dim=32, n_kv_heads=1),
    "gelu_default_width_unscanned": dict(mlp="gelu", d_ff=0, scan_layers=False),
    "relu_parallel_block_tied": dict(mlp="relu", block="parallel", tie_embeddings=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parameter_count_is_exact(variant):
  cfg = dataclasses.replace(BASE, **VARIANTS[variant])
  leaves = jax.tree.leaves(_params(cfg))
  assert sum(math.prod(x.shape) for x in leaves) == cfg.n_params()
  norms = ((1 if cfg.block == "parallel" else 2) * cfg.n_layers + 1) * cfg.d_model
  # a tied head multiplies by the embedding table: a matmul for FLOPs, not a separate parameter
  tied_head = cfg.d_model * cfg.vocab_size if cfg.tie_embeddings else 0
  assert cfg.n_params(embeddings=False) + tied_head == flops.matmul_params(cfg) + norms


def test_non_gated_mlp_has_two_matrices_and_gpt_width():
  cfg = dataclasses.replace(BASE, mlp="gelu", d_ff=0)
  assert cfg.ff == 4 * cfg.d_model and not cfg.gated
  assert dataclasses.replace(BASE, d_ff=0).ff == 192  # swiglu keeps the Llama rule: 8/3 * 64 -> 192
  mlp = _params(cfg)["layers"]["mlp"]
  assert sorted(mlp) == ["w_down", "w_up"]
  assert mlp["w_up"].shape == (cfg.n_layers, 64, 256) and mlp["w_down"].shape == (cfg.n_layers, 256, 64)


@pytest.mark.parametrize("kind", ["swiglu", "gelu", "relu"])
def test_mlp_computes_its_formula(kind):
  cfg = dataclasses.replace(BASE, mlp=kind)
  mlp = model_lib.MLP(cfg)
  x = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model))
  p = nn.unbox(mlp.init(jax.random.key(1), x)["params"])
  got = np.asarray(mlp.apply({"params": p}, x), np.float64)
  xn = np.asarray(x, np.float64)
  up = xn @ np.asarray(p["w_up"], np.float64)
  if kind == "swiglu":
    gate = xn @ np.asarray(p["w_gate"], np.float64)
    h = gate / (1 + np.exp(-gate)) * up
  elif kind == "gelu":  # tanh approximation (GPT-2/GPT-3)
    h = 0.5 * up * (1 + np.tanh(np.sqrt(2 / np.pi) * (up + 0.044715 * up ** 3)))
  else:
    h = np.maximum(up, 0)
  np.testing.assert_allclose(got, h @ np.asarray(p["w_down"], np.float64), rtol=1e-5, atol=1e-6)


def test_head_dim_independent_of_d_model():
  """GPT-3 / 2023 TPU style: 4 heads x 128 = 512 != d_model 64. Projections map D -> H x E and back."""
  cfg = dataclasses.replace(BASE, head_dim=128)
  attn = _params(cfg)["layers"]["attn"]
  assert attn["wq"].shape == (2, 64, 4, 128) and attn["wk"].shape == (2, 64, 2, 128)
  assert attn["wo"].shape == (2, 4, 128, 64)
  model = model_lib.build(cfg)
  params = jax.jit(lambda: nn.unbox(model_lib.init_params(model, jax.random.key(0))))()
  tokens = jnp.arange(32, dtype=jnp.int32)[None] % 256
  logits = jax.jit(lambda p: model.apply({"params": p}, tokens))(params)
  assert logits.shape == (1, 32, 256) and bool(jnp.all(jnp.isfinite(logits)))
  # causality holds at this width too: changing the last token leaves earlier logits alone
  logits2 = jax.jit(lambda p: model.apply({"params": p}, tokens.at[0, -1].set(7)))(params)
  np.testing.assert_array_equal(logits[0, :-1], logits2[0, :-1])


def test_parallel_block_adds_both_branches_of_one_norm():
  cfg = dataclasses.replace(BASE, block="parallel")
  block = model_lib.Block(cfg)
  x = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model))
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  p = nn.unbox(block.init(jax.random.key(1), x, pos, None, None)["params"])
  assert "mlp_norm" not in p
  got, _ = block.apply({"params": p}, x, pos, None, None)
  normed = model_lib.RMSNorm(cfg).apply({"params": p["attn_norm"]}, x)
  attn, _ = model_lib.Attention(cfg).apply({"params": p["attn"]}, normed, pos)
  mlp = model_lib.MLP(cfg).apply({"params": p["mlp"]}, normed)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x + attn + mlp), rtol=1e-5, atol=1e-5)


def _autodiff(fn):
  """The same function differentiated by plain autodiff (no custom rule), for reference."""
  return jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a).astype(jnp.float32))), argnums=(0, 1))


@pytest.mark.parametrize("op", ["rms_norm", "gelu", "swiglu"])
def test_fused_backward_matches_autodiff(op):
  """The norm and activations keep only a fused kernel's residuals; their gradients still equal autodiff's."""
  from framework import layers
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.random.normal(k1, (3, 7, 32), jnp.float32) * 2
  b = jax.random.normal(k2, (32,) if op == "rms_norm" else (3, 7, 32), jnp.float32) + 1
  ref = {"rms_norm": lambda x, s: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * s[None, None],
         "gelu": lambda u, _: jax.nn.gelu(u, approximate=True) * 1.0,
         "swiglu": lambda g, u: jax.nn.silu(g) * u}[op]
  fused = {"rms_norm": lambda x, s: layers.rms_norm(x, s, 1e-5, jnp.dtype("float32")),
           "gelu": lambda u, _: layers.gelu(u), "swiglu": layers.swiglu}[op]
  np.testing.assert_allclose(fused(a, b), ref(a, b), rtol=1e-6, atol=1e-6)
  for got, want in zip(_autodiff(fused)(a, b), _autodiff(ref)(a, b)):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_without_remat_a_layer_keeps_no_float32_copy_of_its_activations():
  """remat='none' keeps what PyTorch's fused kernels keep: no float32 B x T x D or B x T x F residual (the norms'
  float32 input and normalised copy, the activation's float32 intermediates are recomputed in the backward)."""
  cfg = dataclasses.replace(BASE, mlp="gelu", dtype="bfloat16", remat="none", attention="dense")
  model = model_lib.build(cfg)
  params = nn.unbox(model_lib.init_params(model, jax.random.key(0)))
  tokens = jnp.zeros((2, 16), jnp.int32)
  from framework import train_step
  batch = {"inputs": tokens, "targets": tokens}
  _, vjp = jax.vjp(lambda p: train_step.loss_fn(p, batch, model), params)
  residuals = [x for x in jax.tree.leaves(vjp) if hasattr(x, "shape")]
  wide = [r for r in residuals if r.ndim >= 3 and r.shape[-1] in (cfg.d_model, cfg.ff) and r.shape[-2] == 16]
  assert wide, "the residuals of the layer stack are visible"
  assert all(r.dtype == jnp.bfloat16 for r in wide), sorted({(r.dtype.name, r.shape) for r in wide})
  ff = [r for r in wide if r.shape[-1] == cfg.ff]
  assert len(ff) == 2, [r.shape for r in ff]  # the activation's input and output (the down matmul's input)
