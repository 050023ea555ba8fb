"""Token choice from logits: greedy (argmax, the default; bit-identical to llama.cpp's greedy stream) or sampling.

Sampling applies llama.cpp's sampler chain in its order (llama-cpp-python's default chain): repetition penalty
over the last ``penalty_last_n`` tokens (a positive logit divided by the penalty, a negative one multiplied),
top-k, top-p (smallest set whose probability reaches p), min-p (tokens with probability >= min_p * the top one),
temperature, then a draw from the softmax with a seeded numpy generator (``seed``: the same seed, prompt and
parameters give the same tokens). The random stream is numpy's, not llama.cpp's: sampled text matches llama.cpp's
in distribution, not token for token.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 0.0  # <= 0: greedy
  top_k: int = 40  # <= 0: off
  top_p: float = 0.95  # >= 1: off
  min_p: float = 0.05  # <= 0: off
  repeat_penalty: float = 1.0  # 1: off
  penalty_last_n: int = 64
  seed: Optional[int] = None

  def check(self) -> Optional[str]:
    """None, or what is wrong (a message naming the fix)."""
    if not np.isfinite(self.temperature) or self.temperature < 0:
      return f"temperature {self.temperature}: pass a number >= 0 (0 = greedy)"
    if not 0 < self.top_p <= 1:
      return f"top_p {self.top_p}: pass a number in (0, 1]"
    if not 0 <= self.min_p <= 1:
      return f"min_p {self.min_p}: pass a number in [0, 1]"
    if not np.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
      return f"repeat_penalty {self.repeat_penalty}: pass a positive number (1 = off)"
    if self.top_k < 0 or self.penalty_last_n < 0:
      return "top_k and penalty_last_n: pass numbers >= 0"
    return None

  @property
  def greedy(self) -> bool:
    return self.temperature <= 0


class Sampler:
  """``pick(logits_V, history) -> token``; keeps its random generator between calls."""

  def __init__(self, params: SamplingParams = SamplingParams()):
    self.p = params
    self.rng = np.random.default_rng(params.seed)

  def pick(self, logits_V: np.ndarray, history: Sequence[int] = ()) -> int:
    p = self.p
    if p.greedy and p.repeat_penalty == 1.0:
      return int(np.argmax(logits_V))
    x = np.array(logits_V, np.float32)
    if p.repeat_penalty != 1.0 and p.penalty_last_n > 0 and len(history):
      ids = np.unique(np.asarray(history[-p.penalty_last_n:], np.int64))
      v = x[ids]
      x[ids] = np.where(v > 0, v / np.float32(p.repeat_penalty), v * np.float32(p.repeat_penalty))
    if p.greedy:
      return int(np.argmax(x))
    order = np.argsort(-x, kind="stable")
    if p.top_k > 0:
      order = order[:p.top_k]
    z = x[order].astype(np.float64)
    probs = np.exp(z - z[0])
    probs /= probs.sum()
    keep = len(order)
    if p.top_p < 1.0:
      keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p) + 1))
    if p.min_p > 0:
      keep = min(keep, max(1, int((probs >= p.min_p * probs[0]).sum())))
    order, z = order[:keep], z[:keep]
    w = np.exp((z - z[0]) / p.temperature)
    return int(order[self.rng.choice(keep, p=w / w.sum())])
