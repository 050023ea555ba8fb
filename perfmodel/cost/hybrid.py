"""Hybrid cost backend: a node's profiled time (its instruction timed alone, at its exact shapes) times how much
slower such a node ran *inside* the calibration programs than alone, from the nearest calibration samples.

Why: the two other fitted backends fail in opposite ways on a CPU host.
* The learned backend prices from neighbours of other shapes, scaled by a physical estimate. XLA:CPU is
  shape-specific (power-of-two shapes run 1.2-1.65x slower per physical estimate), so it under-predicts programs
  whose shapes the samples do not have.
* The profiled database has the exact shape, but alone, with hot caches: summed over a program it is 0.6-1.15x
  the in-program node times, and one composition scale cannot know which.
The ratio *in-program / alone* of a node class varies less with the shape than the time per physical estimate does,
so the neighbours carry the context and the profiled entry carries the shape. Neighbours are the learned backend's
(same class, same feature space), weighted the same way; only calibration samples whose fingerprint the database
has take part.

*Where* a node ran is a neighbour dimension too: the distance adds ``wp`` x |log program bytes of query - of
sample|, so a ratio comes first from programs that stream about as much. A node timed alone runs with its inputs
hot; in a program the same node runs slower the more the program moves between its runs (weight slices of a decode
loop ran 1.0-1.9x their alone time in a sampler moving 5-10 MB per token, 2.2-3.5x in one moving 24-41 MB).
``wp`` (0: the shape features alone) is chosen by calibration's leave-one-program-out error, one for decode nodes
and one for the others.

A node the database does not have returns None (the chain falls through to the learned backend), so the program
must be profiled first (the CLI's ``predict`` and ``validate`` do that when the backend resolves to hybrid).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from perfmodel.cost import learned
from perfmodel.cost.database import Profiled
from perfmodel.cost.physical import Priced
from perfmodel.graph.nodes import Node
from perfmodel.hardware import HardwareProfile


def _arrays(by_class: dict) -> dict:
  """{class: (shape features, log ratios, log program bytes: NaN where a sample recorded none)}."""
  return {c: (np.array([f for f, _, _ in v]), np.log(np.array([r for _, r, _ in v])),
              np.log(np.array([p if p > 0 else np.nan for _, _, p in v]))) for c, v in by_class.items()}


def context_distance(log_p, program_bytes: float) -> np.ndarray:
  """|log program bytes of the query - of each sample|; 0 where either recorded none (no context: the shape
  features decide alone)."""
  if not program_bytes or program_bytes <= 0:
    return np.zeros_like(log_p)
  return np.nan_to_num(np.abs(np.log(program_bytes) - log_p), nan=0.0)


class Hybrid:
  name = "hybrid"

  def __init__(self, hw: HardwareProfile, samples: Optional[list] = None, db: Optional[Profiled] = None,
               k: Optional[int] = None, k_decode: Optional[int] = None, stat: Optional[str] = None,
               stat_decode: Optional[str] = None, wp: Optional[float] = None, wp_decode: Optional[float] = None):
    # k, stat, wp: neighbour count, sample statistic and program-bytes weight for other nodes; *_decode: for decode
    # nodes (defaults: what calibration chose)
    chosen = hw.calibration.neighbours.get("hybrid", {})
    mine, dec = chosen.get("train"), chosen.get("decode")
    self.k = int(k if k is not None else (mine.k if mine else 4))
    self.k_decode = int(k_decode if k_decode is not None else (dec.k if dec else self.k))
    self.wp = float(wp if wp is not None else (mine.wp if mine else 0.0))
    self.wp_decode = float(wp_decode if wp_decode is not None else (dec.wp if dec else 0.0))
    self.db = db if db is not None else Profiled(hw)
    if samples is None:
      samples = learned.load_samples(hw)
    stat = stat or (mine.stat if mine else "t")
    self.stat = learned.usable_stat(stat, samples)
    self.stat_decode = learned.usable_stat(stat_decode or (dec.stat if dec else stat), samples)
    by_class, by_decode = {}, {}
    for s in samples:
      alone = self.db.seconds(s.get("fp"))
      if alone and alone > 0 and s["t"] > 0:
        where = s.get("P", 0.0)
        by_class.setdefault(learned.strip_context(s["cls"]), []).append((s["f"], s[self.stat] / alone, where))
        if s["cls"].endswith(learned.DECODE):
          by_decode.setdefault(learned.strip_context(s["cls"]), []).append((s["f"], s[self.stat_decode] / alone,
                                                                            where))
    self.arrays = _arrays(by_class)
    # a decode loop's node draws its ratio from the sampler programs' samples (as the learned backend prices it):
    # in the loop, with the weights hot and the KV cache just written, a class runs at another in-program/alone
    # ratio than in a training step
    self.decode_arrays = _arrays(by_decode)

  def context_ratio(self, node: Node) -> Optional[float]:
    """In-program / alone time of the nearest calibration samples of the node's class (weighted geometric mean;
    near in shape and, with ``wp``, in the bytes of the program the sample ran in); a decode node's from the
    sampler programs' samples where they have its class; None for a class no sample has."""
    cls = learned.base_class(node)
    arr = self.decode_arrays.get(cls) if node.decode else None
    k, wp = (self.k_decode, self.wp_decode) if node.decode else (self.k, self.wp)
    if arr is None:
      arr = self.arrays.get(cls)
    if arr is None:
      return None
    X, logR, logP = arr
    d2 = ((X - np.array(learned.features(node))) ** 2).sum(axis=1)
    if wp:
      d2 = d2 + (wp * context_distance(logP, node.program_bytes)) ** 2
    d = np.sqrt(d2)
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
