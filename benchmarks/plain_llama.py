"""A hand-written Llama train step in plain ``jax.numpy``: the baseline the framework is timed against.

Written independently of ``framework/`` on purpose (no flax, no optax, no logical axes, no scan
wrappers): it is what someone would write by hand for one device. Same math as the framework's
step: RMSNorm, rotate-half RoPE, grouped-query causal attention with a dense masked softmax in
float32, SwiGLU, untied (or tied) LM head, mean next-token cross-entropy, then AdamW with
global-norm clipping, linear warm-up + cosine decay, weight decay on matrices only. The benchmark
checks that both give the same loss from the same parameters, so the timing compares like with like.

Shapes in names: B batch, T sequence, D d_model, H query heads, K kv heads, G = H // K, E head_dim,
F d_ff, V vocab, L layers.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Hyper(NamedTuple):
  """Everything the plain step needs, as plain numbers (built from the framework config by the caller)."""
  vocab: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  rope_theta: float
  norm_eps: float
  tie: bool
  dtype: str
  lr: float
  warmup: int
  decay_steps: int
  min_lr_ratio: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  grad_clip: float


class PlainState(NamedTuple):
  step: jax.Array
  params: dict
  mu: dict
  nu: dict


def init_params(hp: Hyper, key, std: float = 0.02) -> dict:
  L, D, H, K, E, F, V = hp.n_layers, hp.d_model, hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.d_ff, hp.vocab
  ks = iter(jax.random.split(key, 9))
  normal = lambda shape: std * jax.random.normal(next(ks), shape, jnp.float32)  # noqa: E731
  p = {
      "embed_VxD": normal((V, D)),
      "attn_norm_LxD": jnp.ones((L, D)), "mlp_norm_LxD": jnp.ones((L, D)), "final_norm_D": jnp.ones((D,)),
      "wq_LxDxHxE": normal((L, D, H, E)), "wk_LxDxKxE": normal((L, D, K, E)), "wv_LxDxKxE": normal((L, D, K, E)),
      "wo_LxHxExD": normal((L, H, E, D)),
      "wg_LxDxF": normal((L, D, F)), "wu_LxDxF": normal((L, D, F)), "wd_LxFxD": normal((L, F, D)),
  }
  if not hp.tie:
    p["head_DxV"] = normal((D, V))
  return p


def from_framework(params) -> dict:
  """Maps the framework's param tree (framework/model.py docstring) onto this file's flat dict."""
  if "layers" in params:
    lay = params["layers"]
  else:  # model.scan_layers=False: layers_0, layers_1, ... -> stacked along a leading L axis
    n = sum(1 for k in params if k.startswith("layers_"))
    lay = jax.tree.map(lambda *xs: jnp.stack(xs), *[params[f"layers_{i}"] for i in range(n)])
  p = {
      "embed_VxD": params["embed"]["embedding"],
      "attn_norm_LxD": lay["attn_norm"]["scale"], "mlp_norm_LxD": lay["mlp_norm"]["scale"],
      "final_norm_D": params["final_norm"]["scale"],
      "wq_LxDxHxE": lay["attn"]["wq"], "wk_LxDxKxE": lay["attn"]["wk"], "wv_LxDxKxE": lay["attn"]["wv"],
      "wo_LxHxExD": lay["attn"]["wo"],
      "wg_LxDxF": lay["mlp"]["w_gate"], "wu_LxDxF": lay["mlp"]["w_up"], "wd_LxFxD": lay["mlp"]["w_down"],
  }
  if "lm_head" in params:
    p["head_DxV"] = params["lm_head"]["kernel"]
  return jax.tree.map(jnp.asarray, p)


def _rms(x_BxTxD, w_D, eps, dtype):
  x = x_BxTxD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
  return (x * w_D[None, None, :]).astype(dtype)


def _rotate(x_BxTxNxE, cos_TxE2, sin_TxE2):
  half = x_BxTxNxE.shape[-1] // 2
  x = x_BxTxNxE.astype(jnp.float32)
  c, s = cos_TxE2[None, :, None, :], sin_TxE2[None, :, None, :]
  lo, hi = x[..., :half], x[..., half:]
  return jnp.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1).astype(x_BxTxNxE.dtype)


def loss(params: dict, tokens_BxT, targets_BxT, hp: Hyper):
  dt = jnp.dtype(hp.dtype)
  B, T = tokens_BxT.shape
  H, K, E = hp.n_heads, hp.n_kv_heads, hp.head_dim
  # RoPE tables once per step (positions are 0..T-1 for every row), shared by all layers.
  inv_freq_E2 = hp.rope_theta ** (-jnp.arange(0, E, 2, dtype=jnp.float32) / E)
  ang_TxE2 = jnp.arange(T, dtype=jnp.float32)[:, None] * inv_freq_E2[None, :]
  cos_TxE2, sin_TxE2 = jnp.cos(ang_TxE2), jnp.sin(ang_TxE2)
  causal_TxT = jnp.tril(jnp.ones((T, T), bool))

  def layer(x_BxTxD, w):
    h = _rms(x_BxTxD, w["attn_norm_LxD"], hp.norm_eps, dt)
    q = _rotate(jnp.einsum("btd,dhe->bthe", h, w["wq_LxDxHxE"].astype(dt)), cos_TxE2, sin_TxE2)
    k = _rotate(jnp.einsum("btd,dke->btke", h, w["wk_LxDxKxE"].astype(dt)), cos_TxE2, sin_TxE2)
    v = jnp.einsum("btd,dke->btke", h, w["wv_LxDxKxE"].astype(dt))
    q_BxTxKxGxE = q.reshape(B, T, K, H // K, E)
    s = jnp.einsum("btkge,bske->bkgts", q_BxTxKxGxE, k).astype(jnp.float32) * (1.0 / math.sqrt(E))
    s = jnp.where(causal_TxT[None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(dt)
    o_BxTxHxE = jnp.einsum("bkgts,bske->btkge", p, v).reshape(B, T, H, E)
    x_BxTxD = x_BxTxD + jnp.einsum("bthe,hed->btd", o_BxTxHxE, w["wo_LxHxExD"].astype(dt))
    h = _rms(x_BxTxD, w["mlp_norm_LxD"], hp.norm_eps, dt)
    g = jnp.einsum("btd,df->btf", h, w["wg_LxDxF"].astype(dt))
    u = jnp.einsum("btd,df->btf", h, w["wu_LxDxF"].astype(dt))
    x_BxTxD = x_BxTxD + jnp.einsum("btf,fd->btd", jax.nn.silu(g) * u, w["wd_LxFxD"].astype(dt))
    return x_BxTxD, None

  layer_params = {k: v for k, v in params.items() if "_Lx" in k}
  x_BxTxD = params["embed_VxD"].astype(dt)[tokens_BxT]
  x_BxTxD, _ = jax.lax.scan(layer, x_BxTxD, layer_params)
  h = _rms(x_BxTxD, params["final_norm_D"], hp.norm_eps, dt)
  w_DxV = params["embed_VxD"].T if hp.tie else params["head_DxV"]
  logits_BxTxV = jnp.einsum("btd,dv->btv", h, w_DxV.astype(dt)).astype(jnp.float32)
  logz_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
  picked_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
  return jnp.mean(logz_BxT - picked_BxT)


def learning_rate(step, hp: Hyper):
  """Linear warm-up from 0, then cosine decay to lr * min_lr_ratio at decay_steps."""
  t = step.astype(jnp.float32)
  warm = hp.lr * t / hp.warmup
  frac = jnp.clip((t - hp.warmup) / (hp.decay_steps - hp.warmup), 0.0, 1.0)
  cos = hp.lr * (hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac)))
  return jnp.where(t < hp.warmup, warm, cos)


def init_state(params: dict) -> PlainState:
  zeros = jax.tree.map(jnp.zeros_like, params)
  return PlainState(jnp.zeros((), jnp.int32), params, zeros, jax.tree.map(jnp.zeros_like, params))


def train_step(state: PlainState, tokens_BxT, targets_BxT, hp: Hyper):
  value, grads = jax.value_and_grad(loss)(state.params, tokens_BxT, targets_BxT, hp)
  gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
  clip = jnp.minimum(1.0, hp.grad_clip / gnorm) if hp.grad_clip > 0 else 1.0
  n = state.step + 1
  lr = learning_rate(state.step, hp)
  bc1, bc2 = 1 - hp.b1 ** n.astype(jnp.float32), 1 - hp.b2 ** n.astype(jnp.float32)
  new_p, new_m, new_v = {}, {}, {}
  for k, p in state.params.items():
    g = grads[k] * clip
    m = hp.b1 * state.mu[k] + (1 - hp.b1) * g
    v = hp.b2 * state.nu[k] + (1 - hp.b2) * jnp.square(g)
    upd = (m / bc1) / (jnp.sqrt(v / bc2) + hp.eps)
    if p.ndim >= 2:  # no weight decay on norm scales
      upd = upd + hp.weight_decay * p
    new_p[k], new_m[k], new_v[k] = p - lr * upd, m, v
  return PlainState(n, new_p, new_m, new_v), {"loss": value, "grad_norm": gnorm}
