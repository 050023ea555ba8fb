"""FLOP accounting for MFU (convention v1, stated so numbers are comparable).

Training FLOPs per token = 6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len, where
N_matmul counts every parameter that takes part in a matmul (all layer matrices and the LM head;
not the embedding gather nor norm scales). The attention term counts QK^T and PV at the *full*
T x T size, because that is what this model executes (a masked dense softmax); the causal-halved
convention (MaxText PR #1988) would use 6 instead of 12. Checked against XLA's own count in
tests/framework/test_flops.py. MFU = achieved model FLOP/s / peak FLOP/s of the hardware used.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from framework.config import ModelConfig

CONVENTION = "v1: 6*N_matmul + 12*L*H*E*T (full attention, as executed)"

# Dense peak FLOP/s per device, from vendor datasheets (bf16 unless noted).
PEAK_FLOPS = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
}


def matmul_params(cfg: ModelConfig) -> int:
  d, h, kv, e, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.hd, cfg.ff
  per_layer = d * h * e + 2 * d * kv * e + h * e * d + 3 * d * f
  return cfg.n_layers * per_layer + d * cfg.vocab_size  # + LM head (tied or not)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  return 2.0 * matmul_params(cfg) + 4.0 * cfg.n_layers * cfg.n_heads * cfg.hd * seq_len


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  return 3.0 * forward_flops_per_token(cfg, seq_len)


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
