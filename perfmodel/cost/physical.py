"""The physical cost backends: what a node costs from the profile's numbers alone.

  * ``roofline``    max(flops / peak, bytes / memory bandwidth) + launch overhead (datasheet profiles)
  * ``calibrated``  the profile's fitted efficiency curves: dots at the achieved FLOP/s of their size, other
                    fusions at the achieved streaming bandwidth of their size plus their element and
                    transcendental work (a CPU does not overlap compute with memory, so these add)
Every backend returns a :class:`Priced` (seconds and which backend priced it) or None (cannot price the node).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from perfmodel.graph.nodes import Node
from perfmodel.hardware import HardwareProfile, interp_log


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
    self.vector_rate = hw.calibration.vector_flops_per_s or hw.peak("f32") / 4

  def price(self, node: Node) -> Optional[Priced]:
    hw, cal = self.hw, self.hw.calibration
    if node.kind == "dot" and node.dot is not None:
      rate = interp_log(hw.dot_curve, max(node.flops, 1.0)) or hw.peak(node.dot.dtype)
      if node.dot.dtype == "bf16":
        rate *= cal.bf16_dot_ratio
      # skinny matmuls (small m, n or k) run far below the square-matrix rate
      small = min(node.dot.m, node.dot.n, node.dot.k)
      rate *= min(1.0, (small / cal.skinny_dim) ** 0.5) if small else 1.0
      extra = max(0.0, node.flops - 2.0 * node.dot.m * node.dot.n * node.dot.k * node.dot.batch)
      return Priced(hw.launch_overhead + node.flops / rate + extra / self.vector_rate, self.name)
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
