"""AdamW with linear warm-up and cosine decay, global-norm clipping (optax)."""
from __future__ import annotations

import optax

from framework.config import OptimConfig


def schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  decay = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
  return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1), decay, cfg.lr * cfg.min_lr_ratio)


def make(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
  # Decay only matrices (ndim >= 2): norms' scales are not weight-decayed, as in Llama.
  def mask(params):
    import jax
    return jax.tree.map(lambda p: getattr(p, "ndim", 0) >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
      optax.adamw(schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay, mask=mask))
