"""Rotary position embedding (RoPE): its frequencies (``model.rope_scaling``) and the rotation.

Frequencies of head dim ``E``: ``inv_freq_j = rope_theta ** (-2j / E)``, j < E/2, divided per frequency by a
factor that depends on ``model.rope_scaling``:

* ``none``: 1 everywhere (plain RoPE).
* ``llama3``: Llama 3.1's scaling (transformers' rope_type 'llama3'). With ``L = rope_original_max_len``, a
  frequency whose wavelength ``2 pi / inv_freq`` is shorter than ``L / rope_high_freq_factor`` keeps its value,
  one longer than ``L / rope_low_freq_factor`` is divided by ``rope_factor``, and those between are interpolated
  smoothly. The divisors are what llama.cpp stores as ``rope_freqs.weight`` (:func:`freq_factors`).

The rotation uses the Hugging Face "rotate-half" layout: dims j and j + E/2 of a head form a pair.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from framework.model_config import ROPE_SCALINGS


def llama3_factors(head_dim: int, theta: float, factor: float = 8.0, low_freq_factor: float = 1.0,
                   high_freq_factor: float = 4.0, original_max_len: int = 8192) -> np.ndarray:
  """Llama 3.1's per-frequency divisors (E/2 float32 values), computed as llama.cpp's converter writes them into
  rope_freqs.weight: 1 above the high-frequency wavelength, ``factor`` below the low one, smooth between."""
  old = float(original_max_len)
  low, high = float(low_freq_factor), float(high_freq_factor)
  freqs = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
  out = []
  for f in freqs.astype(np.float32):
    wavelen = 2 * math.pi / float(f)
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(float(factor))
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / float(factor) + smooth))
  return np.asarray(out, np.float32)


def freq_factors(cfg) -> Optional[np.ndarray]:
  """The divisors of the frequencies of a :class:`~framework.config.ModelConfig`; None for plain RoPE."""
  if cfg.rope_scaling == "none":
    return None
  if cfg.rope_scaling == "llama3":
    return llama3_factors(cfg.hd, cfg.rope_theta, cfg.rope_factor, cfg.rope_low_freq_factor,
                          cfg.rope_high_freq_factor, cfg.rope_original_max_len)
  raise ValueError(f"model.rope_scaling={cfg.rope_scaling!r}; choose one of {ROPE_SCALINGS}")


def rope(x_BxTxNxE, pos_BxT, theta: float, factors: Optional[np.ndarray] = None):
  """Rotary embedding, HF 'rotate_half' layout (first half / second half of head_dim); ``factors``: the
  per-frequency divisors of :func:`freq_factors` (None: plain RoPE)."""
  import jax.numpy as jnp  # noqa: PLC0415 - the frequencies above are numpy: GGUF/HF converters run without jax
  e = x_BxTxNxE.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
  if factors is not None:
    inv_freq = inv_freq / jnp.asarray(factors, jnp.float32)
  ang_BxTxE2 = pos_BxT.astype(jnp.float32)[..., None] * inv_freq.reshape((1,) * pos_BxT.ndim + inv_freq.shape)
  cos, sin = jnp.cos(ang_BxTxE2)[:, :, None, :], jnp.sin(ang_BxTxE2)[:, :, None, :]
  x = x_BxTxNxE.astype(jnp.float32)
  x1, x2 = x[..., : e // 2], x[..., e // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxE.dtype)
