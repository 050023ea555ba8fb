"""The physical cost backends: what a node costs from the profile's numbers alone.

  * ``roofline``    max(flops / peak, bytes / memory bandwidth) + launch overhead (datasheet profiles)
  * ``calibrated``  the profile's fitted efficiency curves: dots at the achieved FLOP/s of their size, other
                    fusions at the achieved streaming bandwidth of their size plus their element and
                    transcendental work (a CPU does not overlap compute with memory, so these add)
  * ``efficiency``  an accelerator from its profile's published curves (hardware.py ``_efficiency_sources``):
                    matrix work (dots, convolutions, attention kernels) at peak[dtype] x the matmul curve at the
                    node's FLOPs (a fused attention kernel: its own published curve at its key/value length
                    where the profile has one), memory traffic at HBM bandwidth x the hbm curve at its bytes; a
                    node costs the larger of the two (one kernel overlaps its loads with its math) plus the
                    launch overhead;
                    where a profile has no curve, :data:`ASSUMED` (listed in the prediction's ``assumptions``)
Every backend returns a :class:`Priced` (seconds and which backend priced it) or None (cannot price the node).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from perfmodel.graph.nodes import Node
from perfmodel.hardware import HardwareProfile, interp_log, load


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


# Efficiencies assumed where a profile publishes no curve; each prediction that used one says so.
ASSUMED = {
    "matmul": ("tpu_v5e", "no published size sweep for this chip: the TPU v5e XLA matmul fractions (jax Pallas TPU "
                          "matmul guide, the profile's efficiency.matmul) stand in for every TPU generation"),
    "hbm": (0.85, "no published streaming sweep for this chip: 0.85 of the datasheet HBM bandwidth, the middle of "
                  "the BabelStream fractions published for A100, H100 and H200 (0.79-0.89, their profiles)"),
}


class Efficiency:
  name = "efficiency"

  def __init__(self, hw: HardwareProfile):
    self.hw, self.assumptions = hw, set()
    eff = hw.efficiency or {}
    self.matmul = eff.get("matmul")
    if self.matmul is None and hw.device_kind.startswith("TPU"):
      self.matmul = load(ASSUMED["matmul"][0]).efficiency["matmul"]
      self.assumptions.add("matmul efficiency: " + ASSUMED["matmul"][1])
    self.hbm = eff.get("hbm")
    self.matrix_dtype = "bf16" if hw.device_kind.startswith("TPU") else ("tf32" if "tf32" in hw.peak_flops else "f32")

  def _rate(self, node: Node) -> float:
    d = node.dot.in_dtype or node.dot.dtype
    dtype = {"f32": self.matrix_dtype, "s8": "int8", "f8e5m2": "f8e4m3fn"}.get(d, d)
    curve = self.matmul
    if dtype.startswith("f8") and (self.hw.efficiency or {}).get("matmul_fp8"):
      curve = self.hw.efficiency["matmul_fp8"]
    frac = interp_log(curve["value"], max(node.flops, 1.0)) if curve else None
    if frac is None:
      frac = 1.0
      self.assumptions.add("matmul efficiency: no curve, datasheet peak")
    if node.dot.kernel.startswith("attention"):
      # the attention curve bounds a large kernel (measured at 16k tokens per call); a small one runs no faster
      # than a matmul of its FLOPs
      attn = self._attention(node.dot)
      frac = frac if attn is None else min(frac, attn)
    return self.hw.peak(dtype) * frac

  def _attention(self, dot) -> Optional[float]:
    """A fused attention kernel's fraction of peak at its key/value length, from the profile's published curve
    of that kernel (forward causal / non-causal, backward); None where the profile has none (the matmul curve
    prices it, by its FLOPs, as any dot)."""
    eff = self.hw.efficiency or {}
    curve = eff.get(dot.kernel)
    if curve is None and dot.kernel == "attention_bwd_causal" and eff.get("attention_bwd"):
      curve = eff["attention_bwd"]
      self.assumptions.add("causal attention backward: the published non-causal backward curve")
    if curve is None:
      self.assumptions.add(f"{dot.kernel}: no published attention curve, priced as a matmul of its FLOPs")
      return None
    return interp_log(curve["value"], max(dot.seq, 1))

  def _bytes_time(self, nbytes: float) -> float:
    if self.hbm is not None:
      frac = interp_log(self.hbm["value"], max(nbytes, 1.0))
    else:
      frac = ASSUMED["hbm"][0]
      self.assumptions.add("HBM efficiency: " + ASSUMED["hbm"][1])
    return nbytes / (self.hw.mem_bandwidth * frac)

  def price(self, node: Node) -> Optional[Priced]:
    hw = self.hw
    t_mem = self._bytes_time(node.bytes) if node.bytes > 0 else 0.0
    if node.kind == "dot" and node.dot is not None and node.flops:
      # the published matmul timings include the kernel's launch: no overhead added on top
      return Priced(max(node.flops / self._rate(node), t_mem), self.name)
    t_vec = node.flops / hw.peak("f32") + node.transcendentals / hw.trans_rate
    return Priced(hw.launch_overhead + max(t_vec, t_mem), self.name)
