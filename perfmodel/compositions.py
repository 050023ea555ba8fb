"""What a calibration fits, as a profile carries it: typed, every term named (the calibration record, the
backends' neighbour choices and their step compositions).

``python -m perfmodel calibrate`` (perfmodel/calib/) measures a host and writes a :class:`Calibration` into the
profile's ``calibration`` field; prediction only reads it. Three parts matter to prediction:

* the fitted rates the ``calibrated`` cost backend needs (vector FLOP/s, skinny-matmul dimension, per-step
  overhead, how many virtual devices the host runs in parallel);
* the neighbour choices of the ``learned`` and ``hybrid`` backends (:class:`Neighbours`);
* one :class:`Composition` per fitted backend: how that backend's node prices add up to a step on this host.

A composition is linear in a step's :class:`StepFeatures`, with its own coefficients per program type
(``train``: one device; ``multi``: N virtual devices sharing the host; ``decode``: one token of a sampler's decode
loop), because the three compose differently on a CPU host.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

PROGRAM_TYPES = ("train", "multi", "decode")
# The terms of a step composition, in the order they are summed.
TERMS = (
    "node_seconds",  # sum of the priced compute nodes x devices
    "node_executions",  # compute-node executions x devices (the executor's per-thunk gap)
    "devices",  # N: a fixed cost per device and step (0 for a decode step: the loop does not re-enter the runtime)
    "collective_seconds",  # modelled collective time over every group
    "collective_executions",  # collective executions x devices
    "fresh_temp_bytes",  # temp bytes the step page-faults afresh (malloc returns large blocks to the OS)
    "node_bytes",  # bytes the compute nodes move x devices, up to the form's knee
    "node_bytes_beyond_knee",  # ... and beyond it (a decode step falls out of the caches)
    "pow2_node_seconds",  # node_seconds again when the step's tokens per device are a power of two
)


@dataclasses.dataclass(frozen=True)
class StepFeatures:
  """What a step is made of, summed over the devices that share the host (perfmodel/compose.py)."""
  node_seconds: float = 0.0
  node_executions: float = 0.0
  devices: float = 0.0
  collective_seconds: float = 0.0
  collective_executions: float = 0.0
  fresh_temp_bytes: float = 0.0
  node_bytes: float = 0.0
  pow2_node_seconds: float = 0.0

  def terms(self, knee: Optional[float] = None) -> list:
    """[(term, value)] in TERMS order, the bytes split at ``knee`` (none: all up to it)."""
    below, beyond = self.node_bytes, 0.0
    if knee:
      below, beyond = min(self.node_bytes, knee), max(0.0, self.node_bytes - knee)
    values = dataclasses.asdict(self)
    values.update(node_bytes=below, node_bytes_beyond_knee=beyond)
    return [(t, values[t]) for t in TERMS]

  def minus(self, other: "StepFeatures", times: float = 1.0) -> "StepFeatures":
    """self - times x other, term by term (a program without ``times`` executions of ``other``)."""
    a, b = dataclasses.asdict(self), dataclasses.asdict(other)
    return StepFeatures(**{k: a[k] - b[k] * times for k in a})


@dataclasses.dataclass(frozen=True)
class Form:
  """One program type's step: sum over TERMS of coefficient x feature."""
  coef: Mapping[str, float]
  knee: Optional[float] = None

  def seconds(self, f: StepFeatures) -> float:
    return sum(self.coef.get(t, 0.0) * v for t, v in f.terms(self.knee))

  def to_dict(self) -> dict:
    return {**{t: float(self.coef.get(t, 0.0)) for t in TERMS}, **({"knee": self.knee} if self.knee else {})}

  @classmethod
  def from_dict(cls, d: dict) -> "Form":
    unknown = set(d) - set(TERMS) - {"knee"}
    if unknown:
      raise ValueError(f"unknown composition term(s) {sorted(unknown)}; terms are {TERMS}")
    return cls(coef={t: float(d.get(t, 0.0)) for t in TERMS}, knee=d.get("knee"))


@dataclasses.dataclass(frozen=True)
class Composition:
  """How one backend's node prices compose into a step, per program type, with the leave-one-program-out error
  it had on the calibration programs (``loo``: one row per program)."""
  forms: Mapping[str, Form]
  loo_mape: Optional[float] = None
  loo: tuple = ()
  source: str = ""

  def seconds(self, features: StepFeatures, program_type: str = "train") -> float:
    return self.forms[program_type if program_type in self.forms else "train"].seconds(features)

  def to_dict(self) -> dict:
    return {"forms": {t: f.to_dict() for t, f in self.forms.items()}, "loo_mape": self.loo_mape,
            "loo": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in self.loo],
            "source": self.source}

  @classmethod
  def from_dict(cls, d: dict) -> "Composition":
    return cls(forms={t: Form.from_dict(f) for t, f in d["forms"].items()}, loo_mape=d.get("loo_mape"),
               loo=tuple(d.get("loo", ())), source=d.get("source", ""))


@dataclasses.dataclass(frozen=True)
class Neighbours:
  """A nearest-neighbour backend's choices for one group of nodes: neighbour count, which statistic of the
  in-program samples it reads (cost/learned.py STATS), and its context weights (learned: working-set exponent
  ``beta``; hybrid: program-bytes weight ``wp``)."""
  k: int = 4
  stat: str = "t"
  beta: float = 0.0
  wp: float = 0.0


@dataclasses.dataclass(frozen=True)
class Calibration:
  date: Optional[str] = None
  profiled_date: Optional[str] = None  # when the calibration programs' instructions were last timed alone
  host: str = ""
  jax: str = ""
  vector_flops_per_s: Optional[float] = None
  skinny_dim: float = 1.0
  bf16_dot_ratio: float = 1.0
  step_overhead_s: float = 0.0
  host_parallelism: float = 1.0
  step_statistic: str = "median"  # which reading of a timed step the compositions were fitted on (median | p10)
  host_malloc: str = "default"  # allocator regime of the fitted step times (framework/host_memory.py)
  compositions: Mapping[str, Composition] = dataclasses.field(default_factory=dict)  # learned | profiled | hybrid
  # backend ('learned' | 'hybrid') -> node group ('train': every node but a decode loop's; 'decode') -> choices
  neighbours: Mapping[str, Mapping[str, Neighbours]] = dataclasses.field(default_factory=dict)
  host_speed: Mapping = dataclasses.field(default_factory=dict)  # the host's reference speed (perfmodel/calib/host.py)
  provenance: Mapping = dataclasses.field(default_factory=dict)  # how and where it was measured

  def to_dict(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["compositions"] = {k: c.to_dict() for k, c in self.compositions.items()}
    d["neighbours"] = {b: {g: dataclasses.asdict(n) for g, n in gs.items()} for b, gs in self.neighbours.items()}
    return d

  @classmethod
  def from_dict(cls, d: Optional[dict]) -> "Calibration":
    d = dict(d or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ValueError(f"unknown calibration field(s) {sorted(unknown)}")
    d["compositions"] = {k: Composition.from_dict(c) for k, c in d.get("compositions", {}).items()}
    d["neighbours"] = {b: {g: Neighbours(**n) for g, n in gs.items()} for b, gs in d.get("neighbours", {}).items()}
    return cls(**d)
