"""Hybrid cost backend: a node's profiled time (its instruction timed alone, at its exact shapes) times how much
slower such a node ran *inside* the calibration programs than alone, from the nearest calibration samples.

Why (perfmodel/JOURNAL.md, "The hybrid backend"): the two fitted backends fail in opposite ways on this CPU.
* The learned backend prices from neighbours of other shapes, scaled by a physical estimate. XLA:CPU is
  shape-specific (power-of-two shapes ran 1.2-1.65x slower per physical estimate), so it under-predicts
  programs whose shapes the samples do not have.
* The profiled database has the exact shape, but alone, with hot caches: summed over a program it is
  0.6-1.15x the in-program node times, and one composition scale cannot know which.
The ratio *in-program / alone* of a node class varies less with the shape than the time per physical estimate
does (dots ~1.2x in both power-of-two and other programs), so the neighbours carry the context and the
profiled entry carries the shape. Neighbours are the learned backend's (same class, same feature space),
weighted the same way; only calibration samples whose fingerprint the database has take part.

A node the database does not have returns None (the chain falls through to the learned backend), so the
program must be profiled first (``predict`` and ``validate`` do that when the backend resolves to hybrid).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from perfmodel import learned
from perfmodel.costs import Priced, Profiled
from perfmodel.graph import Node
from perfmodel.hardware import HardwareProfile

# neighbour counts tried by `calibrate --profiled` (leave-one-program-out picks one for decode nodes, hybrid_k_decode,
# and one for the others, hybrid_k)
K_GRID = (2, 4, 8, 16)


def _arrays(by_class: dict) -> dict:
  return {c: (np.array([f for f, _ in v]), np.log(np.array([r for _, r in v]))) for c, v in by_class.items()}


class Hybrid:
  name = "hybrid"

  def __init__(self, hw: HardwareProfile, samples: Optional[list] = None, db: Optional[Profiled] = None,
               k: Optional[int] = None, k_decode: Optional[int] = None, stat: Optional[str] = None,
               stat_decode: Optional[str] = None):
    self.k = int(k if k is not None else hw.calibration.get("hybrid_k", 4))
    self.k_decode = int(k_decode if k_decode is not None else hw.calibration.get("hybrid_k_decode", self.k))
    self.db = db if db is not None else Profiled(hw)
    if samples is None:
      samples = learned.load_samples(hw)
    # the statistic of the in-program samples (learned.STATS) in the ratios of other nodes and of decode nodes
    stat = stat or hw.calibration.get("hybrid_stat", "t")
    self.stat = learned.usable_stat(stat, samples)
    self.stat_decode = learned.usable_stat(stat_decode or hw.calibration.get("hybrid_stat_decode", stat), samples)
    by_class, by_decode = {}, {}
    for s in samples:
      alone = self.db.seconds(s.get("fp"))
      if alone and alone > 0 and s["t"] > 0:
        by_class.setdefault(learned.strip_context(s["cls"]), []).append((s["f"], s[self.stat] / alone))
        if s["cls"].endswith(learned.DECODE):
          by_decode.setdefault(learned.strip_context(s["cls"]), []).append((s["f"], s[self.stat_decode] / alone))
    self.arrays = _arrays(by_class)
    # a decode loop's node draws its ratio from the sampler programs' samples (as the learned backend prices it,
    # learned.py): in the loop, with the weights hot and the KV cache just written, a class runs at another
    # in-program/alone ratio than in a training step (perfmodel/JOURNAL.md, session 25)
    self.decode_arrays = _arrays(by_decode)

  def context_ratio(self, node: Node) -> Optional[float]:
    """In-program / alone time of the nearest calibration samples of the node's class (weighted geometric mean);
    a decode node's from the sampler programs' samples where they have its class; None for a class no sample
    has."""
    cls = learned.base_class(node)
    arr = self.decode_arrays.get(cls) if node.decode else None
    k = self.k_decode if node.decode else self.k
    if arr is None:
      arr = self.arrays.get(cls)
    if arr is None:
      return None
    X, logR = arr
    d = np.sqrt(((X - np.array(learned.features(node))) ** 2).sum(axis=1))
    idx = np.argsort(d)[:k]
    w = 1.0 / (d[idx] + 0.05)
    return float(np.exp((w * logR[idx]).sum() / w.sum()))

  def price(self, node: Node) -> Optional[Priced]:
    if node.kind not in ("dot", "fusion", "other"):
      return None
    alone = self.db.seconds(node.fingerprint)
    if alone is None:
      return None
    r = self.context_ratio(node)
    if r is None:
      return None
    return Priced(alone * r, self.name)
