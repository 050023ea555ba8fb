"""Decoding over an engine (``forward(tokens, pos0) -> logits``, ``clock``): greedy or sampled (``sampling.py``),
and speculative decoding (greedy).

Prefill asks for the last token's logits only (``last_only``), as llama.cpp computes them when generating, so a
greedy stream equals llama.cpp's bit for bit. ``stop``: a token id or a set of them (the vocabulary's
end-of-generation tokens).

Speculative decoding (greedy acceptance): a draft model held whole on the head proposes ``gamma``
tokens; the target verifies all gamma+1 positions in ONE forward (one ring pass); the longest prefix
where the target's argmax equals the draft is accepted plus the target's own next token. Rejected
positions need no explicit KV rollback: every device writes K/V at the ``pos0`` of each pass and
attends only to rows < pos0 + T, so the next pass simply overwrites them. Output is identical to
plain greedy decoding of the target by construction (and tested), up to float ties in argmax.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from ondevice.forward import GGUFLlama


@dataclasses.dataclass
class GenStats:
  tokens: list
  steps: int  # target forward passes after the prefill
  prefill_s: float
  decode_s: float  # emulated when the engine is emulated, else wall
  drafted: int = 0
  accepted: int = 0
  step_times: list = dataclasses.field(default_factory=list)

  @property
  def tpot_s(self) -> float:
    return self.decode_s / max(1, len(self.tokens) - 1)

  def as_dict(self) -> dict:
    d = {"tokens": len(self.tokens), "target_passes": self.steps, "prefill_s": self.prefill_s,
         "decode_s": self.decode_s, "tpot_ms": 1e3 * self.tpot_s,
         "tokens_per_s": (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else None}
    if self.drafted:
      d["acceptance"] = self.accepted / self.drafted
    return d


def _now(engine) -> float:
  clk = getattr(engine, "clock", None)
  if clk is not None and getattr(engine.head, "emulated", False):
    return clk.now
  return time.perf_counter()


def _stops(stop) -> frozenset:
  if stop is None:
    return frozenset()
  return frozenset([int(stop)]) if isinstance(stop, (int, np.integer)) else frozenset(int(s) for s in stop)


def greedy(engine, prompt: list, n_new: int, stop_id=None, on_token: Optional[Callable] = None,
           sampler=None) -> GenStats:
  """Greedy decoding, or sampling with a ``sampling.Sampler``. ``on_token`` may return True to stop early."""
  stops = _stops(stop_id)
  t0 = _now(engine)
  logits = engine.forward(prompt, 0, last_only=True)
  t1 = _now(engine)
  out, pos, steps = [], len(prompt), 0
  while len(out) < n_new:
    tok = int(np.argmax(logits[-1])) if sampler is None else sampler.pick(logits[-1], list(prompt) + out)
    if tok in stops:
      break
    out.append(tok)
    if on_token and on_token(tok):
      break
    if len(out) == n_new:
      break
    logits = engine.forward([tok], pos)
    pos += 1
    steps += 1
  return GenStats(out, steps, t1 - t0, _now(engine) - t1)


class Draft:
  """The draft model on the head: whole, resident, its own KV cache; time charged to the head clock."""

  def __init__(self, model: GGUFLlama, engine):
    self.model, self.engine = model, engine
    self.cache = model.new_cache()
    self.n_valid = 0  # tokens of the committed sequence whose K/V the draft cache holds

  def propose(self, seq: list, gamma: int) -> list:
    t0 = time.perf_counter()
    self.n_valid = min(self.n_valid, len(seq) - 1)
    logits = self.model.forward(seq[self.n_valid:], self.n_valid, self.cache, batch_invariant=True)
    pos = len(seq)
    out = [int(np.argmax(logits[-1]))]
    for _ in range(gamma - 1):
      logits = self.model.forward([out[-1]], pos, self.cache)
      pos += 1
      out.append(int(np.argmax(logits[-1])))
    self.n_valid = pos  # the last proposal is not in the cache yet
    wall = time.perf_counter() - t0
    head = self.engine.head
    if head.emulated:
      head.clock.now += wall * head.spec.cpu_slowdown
      head.clock.compute_s += wall * head.spec.cpu_slowdown
    return out


def speculative(engine, draft: Draft, prompt: list, n_new: int, gamma: int = 4, stop_id=None,
                on_token: Optional[Callable] = None) -> GenStats:
  stops = _stops(stop_id)
  t0 = _now(engine)
  logits = engine.forward(prompt, 0, last_only=True)
  t1 = _now(engine)
  seq = list(prompt)
  out: list = []
  nxt = int(np.argmax(logits[-1]))
  steps = drafted = accepted = 0
  done = False
  while not done:
    # `nxt` is the target's token at position len(seq); commit it.
    if nxt in stops:
      break
    seq.append(nxt)
    out.append(nxt)
    if on_token:
      on_token(nxt)
    if len(out) >= n_new:
      break
    g = min(gamma, n_new - len(out))
    if len(seq) + g > engine.head.model.max_len:
      g = max(0, engine.head.model.max_len - len(seq))
    if g == 0:
      break
    props = draft.propose(seq, g)
    # One pass verifies [last committed, d1..dg] at positions len(seq)-1 .. len(seq)-1+g.
    logits = engine.forward([seq[-1]] + props, len(seq) - 1, batch_invariant=True)
    steps += 1
    drafted += g
    target = [int(np.argmax(l)) for l in logits]
    n_ok = 0
    while n_ok < g and target[n_ok] == props[n_ok]:
      n_ok += 1
    accepted += n_ok
    for tok in props[:n_ok]:
      if tok in stops:
        done = True
        break
      seq.append(tok)
      out.append(tok)
      if on_token:
        on_token(tok)
      if len(out) >= n_new:
        done = True
        break
    nxt = target[n_ok]
  return GenStats(out, steps, t1 - t0, _now(engine) - t1, drafted, accepted)
