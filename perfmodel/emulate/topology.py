"""Ranks of a target mesh: coordinates, collective groups and a rank's position inside a group.

Devices are numbered row-major over the mesh axes in ``framework.config.MESH_AXES`` order
('pipeline', 'data', 'fsdp', 'sequence', 'expert', 'tensor'): tensor innermost, so a tensor-parallel group is
a run of neighbouring ids, which is the layout ``perfmodel.cost.collectives`` maps onto link levels
(``id // level.size`` is the NVLink island). Nothing here allocates or needs devices: an
8192-rank mesh is just arithmetic.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from framework.config import MESH_AXES


@dataclasses.dataclass(frozen=True)
class RankSpace:
  sizes: tuple  # ((axis, size), ...) in MESH_AXES order

  @staticmethod
  def of(sizes: dict) -> "RankSpace":
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
      raise ValueError(f"unknown mesh axes {sorted(unknown)}; known: {', '.join(MESH_AXES)}")
    return RankSpace(tuple((a, int(sizes.get(a, 1))) for a in MESH_AXES))

  @property
  def axis_sizes(self) -> dict:
    return dict(self.sizes)

  @property
  def n(self) -> int:
    return math.prod(s for _, s in self.sizes)

  def coords(self, rank: int) -> dict:
    if not 0 <= rank < self.n:
      raise ValueError(f"rank {rank} is outside the mesh of {self.n} ranks (0..{self.n - 1})")
    out = {}
    for a, s in reversed(self.sizes):
      out[a] = rank % s
      rank //= s
    return {a: out[a] for a, _ in self.sizes}

  def rank(self, coords: dict) -> int:
    r = 0
    for a, s in self.sizes:
      r = r * s + int(coords.get(a, 0))
    return r

  def group(self, rank: int, axes: Sequence[str]) -> tuple:
    """Ranks that differ from ``rank`` only along ``axes`` (a collective's replica group), ordered by
    the linear index over ``axes`` in the order given (all_gather concatenates in that order)."""
    c = self.coords(rank)
    sizes = self.axis_sizes
    axes = tuple(axes)
    out = []
    for i in range(math.prod(sizes[a] for a in axes)):
      cc, rem = dict(c), i
      for a in reversed(axes):
        cc[a] = rem % sizes[a]
        rem //= sizes[a]
      out.append(self.rank(cc))
    return tuple(out)

  def position(self, rank: int, axes: Sequence[str]) -> int:
    """Index of ``rank`` inside its group over ``axes`` (what ``axis_index`` returns for those axes)."""
    c, sizes, i = self.coords(rank), self.axis_sizes, 0
    for a in axes:
      i = i * sizes[a] + c[a]
    return i

  def describe(self) -> str:
    return ",".join(f"{a}={s}" for a, s in self.sizes if s != 1) or "single"


def parse_mesh(text: str) -> dict:
  """'data=64,tensor=8,pipeline=16' -> {'data': 64, 'tensor': 8, 'pipeline': 16}."""
  out = {}
  for part in (text or "").split(","):
    if not part.strip():
      continue
    k, eq, v = part.partition("=")
    if not eq or k.strip() not in MESH_AXES:
      raise ValueError(f"--mesh entry {part!r} must be axis=size with axis one of {', '.join(MESH_AXES)}")
    out[k.strip()] = int(v)
  return out
