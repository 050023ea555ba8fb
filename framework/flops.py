"""FLOP accounting: model FLOPs for MFU, hardware FLOPs with recompute, each convention a parameter.

Model FLOPs per token (the default, convention v1) = 6 * N_matmul + 12 * n_layers * n_heads * head_dim * T,
where N_matmul counts every parameter that takes part in a matmul: all layer matrices (3 MLP matrices for
swiglu, 2 for gelu/relu; q/k/v/o at their GQA and head_dim widths) and the LM head, tied or not (a tied
head multiplies by the embedding table); not the embedding gather nor norm scales. The attention term is
QK^T and PV for every query against all T keys: 2 matmuls x 2 FLOPs x H x E x T per token, forward. Two
conventions differ between publishers, so both are parameters:

* ``causal_half``: count only the causal half of the attention products (MaxText since PR #1988, and
  kernels that skip masked blocks execute about that). The default, ``False``, is what the dense and
  blockwise kernels execute (every masked score is computed) and what PaLM's ``6N + 12LHQT`` counts.
* ``recompute``: hardware FLOPs add the forward work the backward pass runs again. ``none`` (the default)
  gives model FLOPs. Published conventions: ``full_forward`` (every layer's forward once more,
  Megatron-LM's HFU with full recomputation; the LM head is not recomputed) and ``selective`` (the
  attention products only, Megatron's selective recomputation). What this model executes: a ``model.remat``
  policy name (the groups of framework/remat.py ``RECOMPUTES`` under it), or ``executed`` (the config's own
  ``remat``); both add the attention kernel's own recompute (:data:`KERNEL_RECOMPUTE`).

Checked against the matmuls of the real train step in tests/framework/test_flops.py. MFU = achieved model
FLOP/s / peak FLOP/s of the hardware used.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from framework import remat as remat_lib
from framework.config import ModelConfig

CONVENTION = "v1: 6*N_matmul + 12*L*H*E*T (full attention, as executed)"

# Published recomputation conventions, as the matmul groups of a layer they re-run (remat_lib.GROUPS).
RECOMPUTE_CONVENTIONS = {"full_forward": remat_lib.GROUPS, "selective": ("attn",)}
# Fraction of the attention forward that a kernel's backward recomputes by design: flash-style kernels keep
# only the log-sum-exp and recompute QK^T (one of the two attention products) block by block.
KERNEL_RECOMPUTE = {"dense": 0.0, "dot_product": 0.0, "blockwise": 0.5, "splash": 0.5, "cudnn": 0.5,
                    "ring": 0.5}

# Dense peak FLOP/s per device, from vendor datasheets (bf16 unless noted).
PEAK_FLOPS = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
}


def layer_matmul_params(cfg: ModelConfig) -> dict:
  """Matmul parameters of one layer by group (the groups of remat_lib.GROUPS, minus 'attn')."""
  d, h, kv, e, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.hd, cfg.ff
  if cfg.moe:  # the experts a token goes through (k routed + the shared ones), and the router
    f = cfg.expert_ff * (cfg.experts_per_token + cfg.n_shared_experts)
    return {"qkv": d * (h + 2 * kv) * e, "out": h * e * d, "mlp_in": 2 * d * f + d * cfg.n_experts, "mlp_out": f * d}
  return {"qkv": d * (h + 2 * kv) * e, "out": h * e * d, "mlp_in": (cfg.mlp_matrices - 1) * d * f,
          "mlp_out": f * d}


def matmul_params(cfg: ModelConfig) -> int:
  return cfg.n_layers * sum(layer_matmul_params(cfg).values()) + cfg.d_model * cfg.vocab_size  # + LM head


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, causal_half: bool = False) -> float:
  """Forward FLOPs of QK^T and PV for one token in one layer."""
  return 4.0 * cfg.n_heads * cfg.hd * seq_len * (0.5 if causal_half else 1.0)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal_half: bool = False) -> float:
  return 2.0 * matmul_params(cfg) + cfg.n_layers * attention_flops_per_token(cfg, seq_len, causal_half)


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, recompute: str, *, causal_half: bool = False) -> float:
  """Forward FLOPs the backward pass runs again per token (see the module docstring for ``recompute``)."""
  if recompute == "none":
    return 0.0
  kernel = 0.0
  if recompute in RECOMPUTE_CONVENTIONS:
    groups = RECOMPUTE_CONVENTIONS[recompute]
  else:
    policy = cfg.remat if recompute == "executed" else recompute
    if policy not in remat_lib.RECOMPUTES:
      raise ValueError(f"recompute={recompute!r}; choose 'none', 'executed', one of {sorted(RECOMPUTE_CONVENTIONS)} "
                       f"or a model.remat policy {sorted(remat_lib.RECOMPUTES)}")
    groups = remat_lib.RECOMPUTES[policy]
    kernel = KERNEL_RECOMPUTE[cfg.attention]
  per_layer = layer_matmul_params(cfg)
  flops = sum(2.0 * per_layer[g] for g in groups if g != "attn")
  attention = attention_flops_per_token(cfg, seq_len, causal_half)
  flops += attention * (("attn" in groups) + kernel)
  return cfg.n_layers * flops


def train_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal_half: bool = False,
                          recompute: str = "none") -> float:
  """Forward + backward (2x forward) FLOPs per token, plus the recomputed forward work if asked."""
  model = 3.0 * forward_flops_per_token(cfg, seq_len, causal_half=causal_half)
  if recompute == "none":
    return model  # exactly the model-FLOPs expression: MFU and the performance model's pins read it
  return model + recompute_flops_per_token(cfg, seq_len, recompute, causal_half=causal_half)


def measure_matmul_peak(n: int = 1024, dtype=jnp.float32, reps: int = 10) -> float:
  """Dense matmul FLOP/s of this host's default device (all its cores), median of reps."""
  dev = jax.local_devices()[0]
  a = jax.device_put(jnp.ones((n, n), dtype), dev)
  f = jax.jit(lambda x: (x @ x) * (1.0 / n))
  f(a).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t)
  times.sort()
  return 2.0 * n ** 3 / times[len(times) // 2]


def peak_flops(configured: float = 0.0) -> tuple:
  """(total peak FLOP/s of the devices in use, source). CPU fake devices share the host's cores,
  so on CPU the peak is the host's measured matmul rate, not per emulated device."""
  if configured:
    return configured, "config"
  dev = jax.devices()[0]
  if dev.platform == "cpu":
    return measure_matmul_peak() * jax.process_count(), "measured f32 matmul (host cores)"
  per = PEAK_FLOPS.get(dev.device_kind)
  if per is None:
    return measure_matmul_peak(4096, jnp.bfloat16) * jax.device_count(), f"measured bf16 matmul ({dev.device_kind})"
  return per * jax.device_count(), f"datasheet {dev.device_kind}"
