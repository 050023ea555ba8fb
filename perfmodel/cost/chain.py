"""The cost chain: which backend prices which node of a graph.

A :class:`Chain` asks its backends in order and the first that can price a node wins; the node's price records who
priced it. Collective nodes always go to perfmodel/cost/collectives.py (the model emulation uses too); ``wait`` and
``loop`` nodes cost nothing themselves (the timeline places their time), nor does ``Node.indexing`` under a
framework of :data:`LAYERS_APART`.

Backends (:func:`make_chain`): ``roofline`` and ``calibrated`` (perfmodel/cost/physical.py), ``profiled``
(perfmodel/cost/database.py), ``learned`` (perfmodel/cost/learned.py) and ``hybrid`` (perfmodel/cost/hybrid.py).
``auto`` takes the fitted backend whose composition had the lowest leave-one-program-out error on the calibration
programs (:func:`resolve_backend`).
"""
from __future__ import annotations

from parallelism import target_flags
from perfmodel.cost import collectives, hybrid, learned
from perfmodel.cost.database import Profiled
from perfmodel.cost.physical import Calibrated, Efficiency, Priced, Roofline
from perfmodel.graph.nodes import Node
from perfmodel.hardware import HardwareProfile

# backends whose prices are the program's own instructions timed alone: the program is profiled first
# (perfmodel/cost/profiler.py; 2-20 s the first time a program is seen, cached by fingerprint)
NEEDS_PROFILED_PROGRAM = ("profiled", "hybrid")
FITTED = ("learned", "profiled", "hybrid")  # the backends a calibration fits a composition for
# PyTorch frameworks: each layer's weights, gradients and saved activations are tensors of their own, so picking a
# layer's (a tick's) slice is a pointer where the compiled step copies it out of (into) a stacked array
LAYERS_APART = ("megatron", "nemo", "torchtitan", "llm-foundry")


class Chain:
  def __init__(self, backends: list, hw: HardwareProfile, algorithm: str = "auto", placement=None):
    self.backends, self.hw, self.algorithm = backends, hw, algorithm
    self.placement = placement  # collectives.Placement of a program compiled for the target (None: by ids)
    self.notes = set()  # assumptions the collective model made (where a profile has no curve)
    self.layers_apart = False  # Node.indexing costs nothing (make_chain: a framework of LAYERS_APART)

  @property
  def names(self) -> list:
    return [b.name for b in self.backends]

  def price(self, node: Node) -> Priced:
    if node.collective is not None:
      c = collectives.node_cost(node.collective, self.hw, self.algorithm, placement=self.placement, notes=self.notes)
      return Priced(c.seconds + self.hw.launch_overhead, f"collective:{c.algorithm}")
    if node.kind in ("wait", "loop"):
      return Priced(0.0, "none")
    if node.indexing and self.layers_apart:
      self.notes.add("picking or storing a slice of a stacked array: free (the framework keeps layers apart)")
      return Priced(0.0, "indexing:layers-apart")
    for b in self.backends:
      p = b.price(node)
      if p is not None:
        return p
    return Priced(self.hw.launch_overhead, "launch-only")

  @property
  def assumptions(self) -> list:
    """What the prices assumed where the profile has no published number (Efficiency and the collectives)."""
    out = set(self.notes)
    for b in self.backends:
      out |= getattr(b, "assumptions", set())
    return sorted(out)

  def composition(self):
    """The profile's fitted composition for this chain's first backend (None: the timeline's makespan is the
    step)."""
    first = self.names[0] if self.names else ""
    return self.hw.calibration.compositions.get(first) if first in FITTED else None


def resolve_backend(hw: HardwareProfile, backend: str = "auto") -> str:
  """What ``auto`` means for this profile: of the fitted backends, the one whose composition had the lowest
  leave-one-program-out error *on the calibration programs* (never on a validation: that would make the next
  validation a fitted number); learned where no other has a composition. Returns 'auto' for learned (its chain
  falls through to the others)."""
  if backend != "auto":
    return backend
  fitted = {name: c.loo_mape for name, c in hw.calibration.compositions.items()
            if name in FITTED and c.loo_mape is not None}
  if not fitted:
    return "auto"
  best = min(fitted, key=lambda name: (fitted[name], name != "learned"))  # a tie keeps learned
  return "auto" if best == "learned" else best


def make_chain(hw: HardwareProfile, backend: str = "auto", algorithm: str = "auto", framework: str = None) -> Chain:
  """backend: 'roofline' | 'calibrated' | 'efficiency' | 'profiled' | 'learned' | 'hybrid' | 'auto'
  (:func:`resolve_backend`; an accelerator profile: efficiency; where that keeps learned: learned -> profiled ->
  calibrated -> roofline, each where available); ``framework``: the step's (:data:`LAYERS_APART`)."""
  chain = _make(hw, backend, algorithm)
  chain.layers_apart = target_flags.framework_key(framework) in LAYERS_APART
  return chain


def _make(hw: HardwareProfile, backend: str, algorithm: str) -> Chain:
  backend = resolve_backend(hw, backend)
  has_samples = learned.Learned.available(hw)
  if backend in ("learned", "hybrid") and not has_samples:
    raise ValueError(f"profile {hw.name!r} has no learned node samples: run `python -m perfmodel calibrate`")
  if backend == "learned":
    return Chain([learned.Learned(hw), Calibrated(hw), Roofline(hw)], hw, algorithm)
  if backend == "roofline":
    return Chain([Roofline(hw)], hw, algorithm)
  if backend == "calibrated":
    return Chain([Calibrated(hw)], hw, algorithm)
  if backend == "efficiency" or (backend == "auto" and not hw.calibrated and hw.device_kind != "cpu"
                                 and not has_samples):
    return Chain([Efficiency(hw)], hw, algorithm)
  if backend == "profiled":
    # what the profiler leaves out (in-place updates, ...) goes to the learned backend
    rest = [learned.Learned(hw)] if has_samples else []
    return Chain([Profiled(hw)] + rest + [Calibrated(hw) if hw.calibrated else Roofline(hw)], hw, algorithm)
  if backend == "hybrid":
    # a node the database lacks, or of a class no sample has, is priced by the learned backend
    return Chain([hybrid.Hybrid(hw), learned.Learned(hw), Calibrated(hw)], hw, algorithm)
  if backend != "auto":
    raise ValueError(f"unknown cost backend {backend!r}: choose roofline, calibrated, efficiency, profiled, learned, "
                     f"hybrid or auto")
  chain = [learned.Learned(hw)] if has_samples else []
  chain.append(Profiled(hw))
  if hw.calibrated:
    chain.append(Calibrated(hw))
  chain.append(Roofline(hw))
  return Chain(chain, hw, algorithm)
