"""Hardware profiles: one typed, frozen dataclass per device kind, loaded from ``perfmodel/profiles/*.json``.

A profile calibrated on this host by ``python -m perfmodel calibrate`` lives in the user's cache
(``$PRISMLLM_CACHE/profiles``, else ``~/.cache/prismllm/profiles``) and is loaded in place of the committed one of
the same name; ``calibrate --commit`` writes the committed one instead.

Every number in a profile file is ``{"value": ..., "source": "..."}`` so a reader can check it; the
loader keeps the sources next to the values (``HardwareProfile.sources``). A profile whose
efficiency curves were not fitted on the device is ``calibrated=False`` and predictions made with
it say so.

Links are a list of levels, innermost first (e.g. NVLink island of 8, then the InfiniBand fat-tree;
or a TPU torus). The collective model maps a replica group onto these levels.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

from perfmodel.compositions import Calibration

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")
CACHE_ENV = "PRISMLLM_CACHE"


def cache_root() -> str:
  """The user's PrismLLM cache: ``$PRISMLLM_CACHE``, else ``~/.cache/prismllm`` (never the repository)."""
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "prismllm")


def user_profile_dir() -> str:
  """Where ``calibrate`` writes profiles calibrated on this host (without ``--commit``)."""
  return os.path.join(cache_root(), "profiles")


def profile_path(name: str) -> str:
  """The file ``load(name)`` reads: the user's calibrated profile when there is one, else the committed one."""
  user = os.path.join(user_profile_dir(), f"{name}.json")
  return user if os.path.exists(user) else os.path.join(PROFILE_DIR, f"{name}.json")


@dataclasses.dataclass(frozen=True)
class LinkLevel:
  name: str  # 'nvlink', 'ib', 'ici', 'loopback'
  size: int  # devices per domain at this level (8 for an NVLink island; 0 = unbounded)
  bandwidth: float  # bytes/s per device, one direction (the bus bandwidth a ring step sees)
  latency: float  # seconds per hop / message (alpha)
  topology: str = "switch"  # switch | fat-tree | torus2d | torus3d | ring


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  name: str
  device_kind: str
  peak_flops: dict  # dtype -> FLOP/s (dense)
  mem_bandwidth: float  # bytes/s (HBM or DRAM)
  mem_bytes: float  # device memory capacity
  launch_overhead: float  # seconds per executed kernel / thunk
  links: tuple  # LinkLevel, innermost first
  transcendental_rate: float = 0.0  # transcendental element ops per second (0 -> peak f32 / 8)
  overlap_slowdown: float = 0.0  # fraction by which overlapped compute+communication slow each other
  calibrated: bool = False
  # Fitted efficiency curves (empty when uncalibrated): lists of [x, y] points, interpolated in log x.
  dot_curve: tuple = ()  # [flops, achieved FLOP/s]
  stream_curve: tuple = ()  # [bytes, achieved bytes/s]
  collective_curve: dict = dataclasses.field(default_factory=dict)  # kind -> [[bytes, seconds], ...] (n=2)
  # Each further operand of a combined (tuple) call of that kind, issued together with the first (n=2).
  collective_next_curve: dict = dataclasses.field(default_factory=dict)
  # Exact calls measured on this host (n=2): call_key(kind, sizes) -> seconds (emulate --replay-collectives).
  collective_calls: dict = dataclasses.field(default_factory=dict)
  calibration: Calibration = dataclasses.field(default_factory=Calibration)  # what `calibrate` fitted (typed)
  sources: dict = dataclasses.field(default_factory=dict)  # field -> source text
  efficiency: dict = dataclasses.field(default_factory=dict)  # published curves (schema: _efficiency_sources)

  def peak(self, dtype: str) -> float:
    return self.peak_flops.get(dtype) or self.peak_flops.get("f32") or max(self.peak_flops.values())

  @property
  def trans_rate(self) -> float:
    return self.transcendental_rate or self.peak("f32") / 8


def _value(v):
  return v["value"] if isinstance(v, dict) and "value" in v else v


def _source(v):
  return v.get("source", "") if isinstance(v, dict) else ""


def _efficiency_sources(eff: dict, prefix: str = "efficiency") -> dict:
  """Sources of the ``efficiency`` section, keyed ``efficiency.<curve>`` / ``efficiency.<group>.<kind>``.

  Schema (every curve is ``{"value": [[x, y], ...], "source": ..., ...}``, interpolate in log x):
    matmul / matmul_fp8: x = FLOPs of one dot (2mnk), y = achieved / peak_flops[dtype]; keys dtype, shapes,
        timing, optional max_fraction {"value", "source"} (best shape found, not a point of the curve).
    hbm: x = bytes one kernel moves (read + write), y = achieved / mem_bandwidth.
    attention_fwd / attention_fwd_causal / attention_bwd: a fused attention kernel (cuDNN flash attention);
        x = key/value sequence length, y = achieved / peak_flops[dtype] with a causal mask's FLOPs halved.
    collectives / collectives_outer: {kind: curve} for the innermost link level (NVLink island, ICI slice) /
        across domains (InfiniBand, DCN); x = S, the full buffer (all-reduce operand, all-gather output,
        reduce-scatter input); y = NCCL-tests bus bandwidth in bytes/s (unit "busbw") or as a fraction of that
        level's LinkLevel.bandwidth (unit "busbw_fraction"); group = devices measured, level = LinkLevel name.
  """
  out = {}
  for key, val in eff.items():
    if not isinstance(val, dict):
      continue
    if "value" in val:
      out[f"{prefix}.{key}"] = val.get("source", "")
    else:
      out.update(_efficiency_sources(val, f"{prefix}.{key}"))
  return out


def from_dict(d: dict) -> HardwareProfile:
  sources = {}
  kw = {}
  for f in dataclasses.fields(HardwareProfile):
    if f.name not in d or f.name == "sources":
      continue
    raw = d[f.name]
    if f.name == "peak_flops":
      kw[f.name] = {k: float(_value(v)) for k, v in raw.items()}
      sources.update({f"peak_flops.{k}": _source(v) for k, v in raw.items()})
    elif f.name == "links":
      levels = []
      for lv in raw:
        levels.append(LinkLevel(**{k: _value(v) for k, v in lv.items() if k != "source"}))
        sources[f"links.{lv['name']}"] = lv.get("source", "") or "; ".join(
            f"{k}: {_source(v)}" for k, v in lv.items() if _source(v))
      kw[f.name] = tuple(levels)
    elif f.name == "efficiency":
      kw[f.name] = raw
      sources.update(_efficiency_sources(raw))
    elif f.name in ("dot_curve", "stream_curve"):
      kw[f.name] = tuple(tuple(p) for p in _value(raw))
      sources[f.name] = _source(raw)
    elif f.name == "calibration":
      kw[f.name] = Calibration.from_dict(_value(raw))
      sources[f.name] = _source(raw)
    else:
      kw[f.name] = _value(raw)
      if _source(raw):
        sources[f.name] = _source(raw)
  unknown = set(d) - {f.name for f in dataclasses.fields(HardwareProfile)} - {"comment"}
  if unknown:
    raise ValueError(f"unknown hardware-profile field(s) {sorted(unknown)}; fix the profile file")
  return HardwareProfile(sources=sources, **kw)


def available() -> list:
  dirs = [d for d in (PROFILE_DIR, user_profile_dir()) if os.path.isdir(d)]
  return sorted({f[:-5] for d in dirs for f in os.listdir(d) if f.endswith(".json")})


def load(name_or_path: str) -> HardwareProfile:
  path = name_or_path if name_or_path.endswith(".json") else profile_path(name_or_path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no hardware profile {name_or_path!r}; available: {', '.join(available())} "
                            f"(or pass a path to a .json profile)")
  with open(path) as f:
    return from_dict(json.load(f))


def interp_log(curve, x: float) -> Optional[float]:
  """Piecewise-linear interpolation in log(x) of [[x, y], ...]; clamps at the ends."""
  if not curve:
    return None
  pts = sorted(curve)
  if x <= pts[0][0]:
    return pts[0][1]
  if x >= pts[-1][0]:
    return pts[-1][1]
  for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
    if x0 <= x <= x1:
      t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
      return y0 + t * (y1 - y0)
  return pts[-1][1]
