"""Learned cost backend: node times measured inside calibration programs, generalised by nearest neighbours.

Samples come from ``python -m perfmodel calibrate`` (perfmodel/calib/nodes.py): every dot / fusion / copy of a
calibration suite of real training steps and decode loops (disjoint from the validation suite), timed in-program by
XLA's TraceMe. A query node is priced from the k nearest samples of its class in log feature space (bytes, flops,
transcendentals, bytes written, a layout-change flag; m, n, k, batch for dots), each neighbour's time scaled by the
ratio of the physical (calibrated-curve) estimates of query and neighbour: data where there is data, physics for
the gap. Two context effects the shape features miss:

* *where* a node runs: the same fusion is slower in a program that streams more bytes (its inputs have left the
  caches), so each neighbour is scaled by (query program bytes / neighbour program bytes) ** beta;
* *when* it runs: a node inside a sampler's decode loop (``Node.decode``) is a tiny thunk run again every token with
  the weights and KV cache hot. Its class's neighbours from training steps overprice it, so a decode node is priced
  from the sampler programs' samples (their class carries ``@decode``), with its own k and beta; a class no sampler
  sample has falls back to all samples.

k, beta and which statistic of a node's in-program times a sample stands for are chosen by calibration's
leave-one-program-out error (``Calibration.neighbours["learned"]``). A query farther than ``ood_distance`` from
every sample, or of a class never seen, is priced the same way but labelled ``learned(out-of-range)``.
"""
from __future__ import annotations

import math
import os
import re
from typing import Optional

import numpy as np

from perfmodel.cost.database import load_json, samples_path
from perfmodel.cost.physical import Calibrated, Priced
from perfmodel.graph.nodes import Node
from perfmodel.hardware import HardwareProfile


def node_class(n: Node) -> str:
  """Neighbours are drawn from the query's own class only. Besides the op kind, two splits: a dot XLA emits itself
  ('dot', on a CPU a transposed operand the kernel library was not given) runs about 2x slower per flop than the
  library's (a 'ynn_fusion') of the same m, n, k; a layout change that moves the minor-most dimension runs 2-4.5x
  slower per byte than one that keeps it. A node of a decode loop gets the suffix ``@decode`` (module docstring)."""
  return base_class(n) + (DECODE if n.decode else "")


DECODE = "@decode"  # class suffix of a node inside a decode loop (Node.decode)
# Which statistic of a node's in-program times a sample stands for (perfmodel/calib/nodes.py): "t" the p25
# (robust to preemption by other processes), "t50" the median, "tm" the mean (what a step pays when the spread is
# the program's own, as a decode loop's KV-cache reads). Calibration chooses one for the training and multi-device
# nodes and one for decode nodes, by leave-one-program-out error, among those every sample has.
STATS = ("t", "t50", "tm")


def stats_of(samples: list) -> tuple:
  """The statistics of STATS that every sample carries."""
  return tuple(st for st in STATS if samples and all(st in s for s in samples)) or ("t",)


def usable_stat(stat: str, samples: list) -> str:
  """``stat`` where every sample carries it, else the p25 ("t") every sample has."""
  return stat if stat == "t" or (samples and all(stat in s for s in samples)) else "t"


def base_class(n: Node) -> str:
  """The class without the decode context."""
  if n.kind == "dot":
    return "dot:plain" if n.opcode == "dot" else "dot"
  op = n.opcode.split(":")
  base = op[0]
  minor = "/minor" if n.moves_minor else ""
  if base == "fusion":
    return "fusion:" + (op[1] if len(op) > 1 else "") + minor
  return {"copy": "copy" + minor, "transpose": "copy" + minor}.get(base, "op")


def strip_context(cls: str) -> str:
  return cls[:-len(DECODE)] if cls.endswith(DECODE) else cls


# bumped whenever `features` or `node_class` change: a samples file of another version cannot be queried
# (recalibrate, or `calibrate --refit-composition HLO_DIR` re-derives classes and features of the stored samples)
FEATURES_VERSION = 5
_LAYOUT_OPS = {"copy", "transpose"}


def changes_layout(n: Node) -> bool:
  """A copy/transpose node, or a fusion XLA named after a fused copy/transpose ('copy_bitcast_fusion.4')."""
  if n.opcode.split(":")[0] in _LAYOUT_OPS:
    return True
  return n.kind == "fusion" and bool(_LAYOUT_OPS & set(re.sub(r"\.\d+$", "", n.name).split("_")))


def features(n: Node) -> list:
  f = [math.log1p(n.bytes), math.log1p(n.flops), math.log1p(n.transcendentals), math.log1p(n.out_bytes),
       1.0 if changes_layout(n) else 0.0]
  if n.kind == "dot" and n.dot is not None:
    d = n.dot
    f += [math.log(max(1, d.m)), math.log(max(1, d.n)), math.log(max(1, d.k)), math.log(max(1, d.batch))]
  return f


def load_samples(hw: HardwareProfile, path: Optional[str] = None) -> list:
  """The profile's node samples (``calibrate``), refused when written by another ``FEATURES_VERSION``."""
  path = path or samples_path(hw.name)
  data = load_json(path)  # parsed once per version of the file
  version = data.get("meta", {}).get("features_version", 1)
  if version != FEATURES_VERSION:
    raise ValueError(f"{path}: node samples of features version {version}, this code prices with version "
                     f"{FEATURES_VERSION}: run `python -m perfmodel calibrate`")
  return data["samples"]


class Learned:
  name = "learned"

  def __init__(self, hw: HardwareProfile, path: Optional[str] = None, k: Optional[int] = None,
               ood_distance: float = 1.0, samples: Optional[list] = None, beta: Optional[float] = None,
               k_decode: Optional[int] = None, beta_decode: Optional[float] = None, stat: Optional[str] = None,
               stat_decode: Optional[str] = None):
    # k, beta, stat: the neighbour count, working-set exponent and sample statistic for other nodes; *_decode: for
    # decode nodes (defaults: what calibration chose; a decode choice falls back to the other nodes')
    chosen = hw.calibration.neighbours.get("learned", {})
    mine, dec = chosen.get("train"), chosen.get("decode")
    self.hw, self.ood = hw, ood_distance
    self.k = int(k if k is not None else (mine.k if mine else 4))
    self.beta = float(beta if beta is not None else (mine.beta if mine else 0.0))
    self.k_decode = int(k_decode if k_decode is not None else (dec.k if dec else self.k))
    self.beta_decode = float(beta_decode if beta_decode is not None else (dec.beta if dec else self.beta))
    self.phys = Calibrated(hw)
    if samples is None:
      samples = load_samples(hw, path)
    stat = stat or (mine.stat if mine else "t")
    self.stat = usable_stat(stat, samples)
    self.stat_decode = usable_stat(stat_decode or (dec.stat if dec else stat), samples)
    # a sample of a sampler program serves decode queries (its ``@decode`` class) and, like every sample,
    # queries of its training class
    self.by_class = {}
    for s in samples:
      self.by_class.setdefault(strip_context(s["cls"]), []).append(s)
      if s["cls"].endswith(DECODE):
        self.by_class.setdefault(s["cls"], []).append(s)
    self.arrays = {c: (np.array([s["f"] for s in ss]),
                       np.array([s[self.stat_decode if c.endswith(DECODE) else self.stat] for s in ss]),
                       np.array([s["phys"] for s in ss]), np.array([s.get("P", 0.0) for s in ss]))
                   for c, ss in self.by_class.items()}

  @staticmethod
  def available(hw: HardwareProfile) -> bool:
    return hw.calibrated and os.path.exists(samples_path(hw.name))

  def price(self, node: Node) -> Optional[Priced]:
    if node.kind not in ("dot", "fusion", "other"):
      return None
    cls = node_class(node)
    phys = self.phys.price(node)
    if phys is None:
      return None
    k, beta = (self.k_decode, self.beta_decode) if node.decode else (self.k, self.beta)
    arr = self.arrays.get(cls)
    if arr is None and node.decode:  # no sampler program has this class: all samples of it
      arr, k, beta = self.arrays.get(base_class(node)), self.k, self.beta
    if arr is None:
      return Priced(phys.seconds * self._class_scale(), "learned(out-of-range)")
    X, T, PH, P = arr
    q = np.array(features(node))
    d = np.sqrt(((X - q) ** 2).sum(axis=1))
    idx = np.argsort(d)[:k]
    w = 1.0 / (d[idx] + 0.05)
    est = T[idx] * (phys.seconds / PH[idx])
    if beta and node.program_bytes > 0:  # working-set context (a neighbour without one: no scaling)
      est = est * np.where(P[idx] > 0, (node.program_bytes / np.maximum(P[idx], 1.0)) ** beta, 1.0)
    # geometric weighted mean: times span decades, errors are multiplicative
    t = float(np.exp((w * np.log(np.maximum(est, 1e-9))).sum() / w.sum()))
    return Priced(t, "learned" if d[idx[0]] <= self.ood else "learned(out-of-range)")

  def _class_scale(self) -> float:
    """For an unseen class: the median measured/physical ratio over all samples."""
    r = [T / PH for c, (_, T, PH, _) in self.arrays.items() if not c.endswith(DECODE)]  # each sample once
    return float(np.median(np.concatenate(r))) if r else 1.0
