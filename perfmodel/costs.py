"""Operator cost backends. Each prices one graph node and says which backend did it.

  * ``roofline``    max(flops / peak, bytes / memory BW) + launch overhead (datasheet profiles)
  * ``calibrated``  fitted efficiency curves of the profile: dots at the achieved FLOP/s of their
                    size, other fusions at the achieved streaming BW of their size plus element and
                    transcendental work (the CPU does not overlap compute with memory, so these add)
  * ``profiled``    a database of measured times keyed by (device, jax version, node fingerprint);
                    filled per program (``predict --profile-nodes``, ``validate --backend profiled``,
                    ``calibrate --profiled``): every compute instruction cut out of the compiled program,
                    compiled alone and its thunks traced on the real device (perfmodel/fusion_profiler.py;
                    ``--profile-dots`` rebuilds only the dots from m, n, k, batch, dtype)
A :class:`Chain` asks its backends in order; the first that can price a node wins. Collective nodes
always go to ``perfmodel.collectives`` (the same model emulation uses).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from perfmodel import collectives
from perfmodel.graph import Node
from perfmodel.hardware import HardwareProfile, interp_log

DB_DIR = os.path.join(os.path.dirname(__file__), "profiles", "db")


@dataclasses.dataclass(frozen=True)
class Priced:
  seconds: float
  backend: str


class Roofline:
  name = "roofline"

  def __init__(self, hw: HardwareProfile):
    self.hw = hw

  def price(self, node: Node) -> Optional[Priced]:
    hw = self.hw
    dtype = node.dot.dtype if node.dot else "f32"
    t_compute = node.flops / hw.peak(dtype) + node.transcendentals / hw.trans_rate
    t_mem = node.bytes / hw.mem_bandwidth
    return Priced(hw.launch_overhead + max(t_compute, t_mem), self.name)


class Calibrated:
  name = "calibrated"

  def __init__(self, hw: HardwareProfile):
    if not hw.calibrated:
      raise ValueError(f"profile {hw.name!r} has no fitted curves: run `python -m perfmodel calibrate` "
                       f"(CPU) or use the roofline backend")
    self.hw = hw
    self.vector_rate = hw.calibration.get("vector_flops_per_s", hw.peak("f32") / 4)

  def price(self, node: Node) -> Optional[Priced]:
    hw = self.hw
    if node.kind == "dot" and node.dot is not None:
      rate = interp_log(hw.dot_curve, max(node.flops, 1.0)) or hw.peak(node.dot.dtype)
      if node.dot.dtype == "bf16":
        rate *= hw.calibration.get("bf16_dot_ratio", 1.0)
      # skinny matmuls (small m, n or k) run far below the square-matrix rate
      small = min(node.dot.m, node.dot.n, node.dot.k)
      rate *= min(1.0, (small / hw.calibration.get("skinny_dim", 1)) ** 0.5) if small else 1.0
      extra = max(0.0, node.flops - 2.0 * node.dot.m * node.dot.n * node.dot.k * node.dot.batch)
      return Priced(hw.launch_overhead + node.flops / rate + extra / self.vector_rate
                    + self._bytes_time(node.out_bytes) * 0.0, self.name)
    if node.kind in ("fusion", "other"):
      t = hw.launch_overhead + self._bytes_time(node.bytes)
      t += node.flops / self.vector_rate + node.transcendentals / hw.trans_rate
      return Priced(t, self.name)
    return None

  def _bytes_time(self, nbytes: float) -> float:
    if nbytes <= 0:
      return 0.0
    bw = interp_log(self.hw.stream_curve, nbytes) or self.hw.mem_bandwidth
    return nbytes / bw


_LOADED = {}  # (path, mtime, size) -> parsed JSON


def load_json(path: str):
  """``json.load`` of ``path``, parsed once per version of the file: a prediction builds its cost chain afresh
  and the node samples and profiled database are megabytes (0.3-0.7 s of a prediction). Callers must not modify
  the result."""
  st = os.stat(path)
  key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
  if key not in _LOADED:
    if len(_LOADED) >= 8:
      _LOADED.clear()
    with open(path) as f:
      _LOADED[key] = json.load(f)
  return _LOADED[key]


class Profiled:
  """Measured node times keyed by fingerprint; versioned by device kind and jax version."""
  name = "profiled"

  def __init__(self, hw: HardwareProfile, path: Optional[str] = None):
    self.hw = hw
    self.path = path or db_path(hw.name)
    self.table = {}
    if os.path.exists(self.path):
      data = load_json(self.path)
      self.meta = data.get("meta", {})
      self.table = data.get("entries", {})

  def seconds(self, fingerprint: str) -> Optional[float]:
    """The measured time of a node fingerprint; None when the database has none."""
    t = self.table.get(fingerprint)
    if t is None:
      return None
    return float(t["s"]) if isinstance(t, dict) else float(t)  # {"s", "method", "op"}: fusion_profiler.py

  def price(self, node: Node) -> Optional[Priced]:
    s = self.seconds(node.fingerprint)
    if s is None:
      return None
    t = self.table[node.fingerprint]
    return Priced(s, f"{self.name}:{t.get('method', '')}".rstrip(":") if isinstance(t, dict) else self.name)


def db_path(profile: str) -> str:
  import jax
  return os.path.join(DB_DIR, f"{profile}-jax{jax.__version__}.json")


class Chain:
  def __init__(self, backends: list, hw: HardwareProfile, algorithm: str = "auto"):
    self.backends, self.hw, self.algorithm = backends, hw, algorithm

  @property
  def names(self) -> list:
    return [b.name for b in self.backends]

  def price(self, node: Node) -> Priced:
    if node.collective is not None:
      c = collectives.node_cost(node.collective, self.hw, self.algorithm)
      return Priced(c.seconds + self.hw.launch_overhead, f"collective:{c.algorithm}")
    if node.kind in ("wait", "loop"):
      return Priced(0.0, "none")
    for b in self.backends:
      p = b.price(node)
      if p is not None:
        return p
    return Priced(self.hw.launch_overhead, "launch-only")


# backends whose prices are the program's own instructions timed alone: predict / validate profile the program
# first (perfmodel/fusion_profiler.py; 2-20 s the first time a program is seen, cached by fingerprint)
NEEDS_PROFILED_PROGRAM = ("profiled", "hybrid")
# fitted backend -> (its composition's key, its leave-one-program-out MAPE's key) in the profile's calibration
FITTED = {"learned": ("composition", "calibration_loo_mape"),
          "profiled": ("composition_profiled", "calibration_loo_profiled_mape"),
          "hybrid": ("composition_hybrid", "calibration_loo_hybrid_mape")}


def resolve_backend(hw: HardwareProfile, backend: str = "auto") -> str:
  """What ``auto`` means for this profile: of the fitted backends (learned, profiled, hybrid), the one whose
  composition had the lowest leave-one-program-out error *on the calibration programs* (``calibrate`` stores
  learned's, ``calibrate --profiled`` profiled's and hybrid's); learned where no other has a composition.
  Model selection by the calibration's own cross-validation, never by a validation (perfmodel/README.md,
  "Which backend auto uses"). Returns 'auto' for learned (its chain falls through to the others)."""
  if backend != "auto":
    return backend
  cal = hw.calibration or {}
  fitted = {name: cal[loo] for name, (comp, loo) in FITTED.items()
            if cal.get(comp) and cal.get(loo) is not None}
  if not fitted:
    return "auto"
  best = min(fitted, key=lambda name: (fitted[name], name != "learned"))  # a tie keeps learned
  return "auto" if best == "learned" else best


def make_chain(hw: HardwareProfile, backend: str = "auto", algorithm: str = "auto") -> Chain:
  """backend: 'roofline' | 'calibrated' | 'profiled' | 'learned' | 'hybrid' | 'auto'
  (auto: :func:`resolve_backend`; where that keeps learned: learned -> profiled -> calibrated -> roofline, each
  where available)."""
  from perfmodel import learned  # noqa: PLC0415 (learned imports this module)
  backend = resolve_backend(hw, backend)
  if backend == "learned":
    if not learned.Learned.available(hw):
      raise ValueError(f"profile {hw.name!r} has no learned node samples: run `python -m perfmodel calibrate`")
    return Chain([learned.Learned(hw), Calibrated(hw), Roofline(hw)], hw, algorithm)
  if backend == "roofline":
    return Chain([Roofline(hw)], hw, algorithm)
  if backend == "calibrated":
    return Chain([Calibrated(hw)], hw, algorithm)
  if backend == "profiled":
    # what the profiler leaves out (in-place updates) goes to the learned backend, as in calibrate --profiled
    rest = [learned.Learned(hw)] if learned.Learned.available(hw) else []
    return Chain([Profiled(hw)] + rest + [Calibrated(hw) if hw.calibrated else Roofline(hw)], hw, algorithm)
  if backend == "hybrid":
    from perfmodel import hybrid  # noqa: PLC0415
    if not learned.Learned.available(hw):
      raise ValueError(f"profile {hw.name!r} has no learned node samples: run `python -m perfmodel calibrate`")
    # a node the database lacks, or of a class no sample has, is priced by the learned backend
    return Chain([hybrid.Hybrid(hw), learned.Learned(hw), Calibrated(hw)], hw, algorithm)
  if backend != "auto":
    raise ValueError(f"unknown cost backend {backend!r}: choose roofline, calibrated, profiled, learned, hybrid "
                     f"or auto")
  chain = [learned.Learned(hw)] if learned.Learned.available(hw) else []
  chain.append(Profiled(hw))
  if hw.calibrated:
    chain.append(Calibrated(hw))
  chain.append(Roofline(hw))
  return Chain(chain, hw, algorithm)
