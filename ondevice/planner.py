"""Turns a GGUF file + device specs into ring windows: Halda, or a baseline split.

Halda's per-device costs come from the profiler's measured per-layer compute on THIS machine, scaled
by each emulated device's ``cpu_slowdown`` / ``gpu_speedup``, its disk speed and RAM budget, and its
link (activation bytes per hop / bandwidth + latency).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from ondevice import halda, halda_moe
from ondevice.emulation import DeviceSpec
from ondevice.gguf_io import GGUFInfo


@dataclasses.dataclass(frozen=True)
class RingPlan:
  windows: list  # [device][cycle] -> layer ids
  n_gpu: tuple
  k: int
  method: str
  model_latency_s: Optional[float] = None  # Halda's objective (a model, not a measurement)
  residency: Optional[tuple] = None  # per device (pin, prefetch) bytes per window (Halda), else None
  prima_cost_s: Optional[float] = None  # prima.cpp's objective for the same windows (for comparison)
  model_disk_mb_per_token: Optional[float] = None
  experts: Optional[dict] = None  # MoE (Halda): resident experts per window and the expected expert reads

  def as_dict(self) -> dict:
    ms = lambda v: None if v is None else 1e3 * v  # noqa: E731
    out = {"method": self.method, "k": self.k, "w": [len(w[0]) if w else 0 for w in self.windows],
           "n_gpu": list(self.n_gpu), "halda_model_latency_ms": ms(self.model_latency_s),
           "prima_cost_ms": ms(self.prima_cost_s), "halda_model_disk_mb_per_token": self.model_disk_mb_per_token}
    if self.experts is not None:
      out["experts"] = {k: v for k, v in self.experts.items() if k != "resident"}
      out["experts"]["resident"] = [[{str(i): sorted(r[i]) for i in sorted(r)} for r in dev]
                                    for dev in self.experts["resident"]]
    return out


def paged_layer_bytes(info: GGUFInfo) -> int:
  """What one layer costs in page cache: the stride between consecutive layers' byte ranges, which
  includes the padding of page-aligned tensors (a tiny model's tensors are padded to pages)."""
  r = [info.layer_range(i) for i in range(info.cfg.n_layers)]
  return max([b[0] - a[0] for a, b in zip(r, r[1:])] + [r[-1][1] - r[-1][0]])


def costs(info: GGUFInfo, specs: Sequence[DeviceSpec], layer_s: float, head_s: float, ctx: int,
          experts: Optional[halda_moe.ExpertProfile] = None) -> tuple:
  """Halda's (devices, model). ``experts``: a MoE file's expert profile (its bytes weighted by frequency)."""
  c = info.cfg
  layer_bytes = paged_layer_bytes(info)
  kv = 2 * ctx * c.n_kv_heads * c.hd * 4
  head_bytes = sum(t.nbytes for n, t in info.tensors.items() if not n.startswith("blk."))
  act = c.d_model * 4
  devs = []
  for m, s in enumerate(specs):
    ram = s.ram_bytes - (head_bytes if m == 0 else 0)
    devs.append(halda.DeviceCost(
        s.name, t_cpu_layer_s=layer_s * s.cpu_slowdown, ram_bytes=ram if math.isfinite(ram) else 1e18,
        disk_Bps=s.disk_Bps if math.isfinite(s.disk_Bps) else 1e18,
        t_gpu_layer_s=layer_s / s.gpu_speedup if s.gpu_speedup else 0.0, vram_bytes=s.vram_bytes,
        link_s=s.link_time(act)))
  model = halda.ModelCost(c.n_layers, layer_bytes, kv, head_s * specs[0].cpu_slowdown)
  if experts is not None:
    model = dataclasses.replace(model, expert_bytes=experts.layer_expert_bytes, expert_curve=halda_moe.curve(experts))
  return devs, model


def split_windows(w: Sequence[int], k: int) -> list:
  return halda.Plan(k, tuple(w), (0,) * len(w), 0.0, ()).windows()


def plan(info: GGUFInfo, specs: Sequence[DeviceSpec], method: str = "halda", k="auto", layer_s: float = 1e-3,
         head_s: float = 0.0, ctx: int = 256, windows: Optional[list] = None, drop_unused: bool = True,
         expert_counts=None) -> tuple:
  """Returns (RingPlan, kept device specs). Methods: halda | memory (exo-like, k=1) | equal (dllama-like)
  | single (everything on device 0) | manual (``windows`` = per-device layer counts per window).
  MoE files with halda: experts weighted by their activation frequency (halda_moe.py), from ``expert_counts``
  (n_layers x n_expert routed tokens) or, without them, the uniform prior top_k / n_expert."""
  L = info.cfg.n_layers
  M = len(specs)
  if method == "single":
    p = RingPlan([[list(range(L))]], (0,), 1, method)
    return p, [specs[0]]
  if method == "manual":
    kk = int(k) if k != "auto" else 1
    p = RingPlan(split_windows(windows, kk), (0,) * M, kk, method)
  elif method == "memory":
    p = RingPlan(split_windows(halda.memory_proportional(costs(info, specs, layer_s, head_s, ctx)[0], L), 1),
                 (0,) * M, 1, method)
  elif method == "equal":
    p = RingPlan(split_windows(halda.equal_split(M, L), 1), (0,) * M, 1, method)
  elif method == "halda":
    prof = None if info.moe is None else halda_moe.profile(info, expert_counts)
    devs, model = costs(info, specs, layer_s, head_s, ctx, prof)
    ks = None if k == "auto" else [int(k)]
    hp = halda.solve(devs, model, ks)
    p = RingPlan(hp.windows(), hp.n, hp.k, method, hp.latency_s,
                 residency=tuple(zip(hp.pin, hp.prefetch)), prima_cost_s=halda.prima_cost(devs, model, hp.k, hp.w, hp.n),
                 model_disk_mb_per_token=hp.disk_bytes_per_token() / 2**20)
    if prof is not None:
      cpu = [[win[:len(win) - hp.n[m]] for win in wins] for m, wins in enumerate(p.windows)]  # device.py: the
      # GPU holds a window's last n layers, experts included
      res = halda_moe.place(prof, cpu, hp.expert_pin)
      p = dataclasses.replace(p, experts={
          "frequencies": prof.source, "expert_pin_mb_per_window": [v / 2**20 for v in hp.expert_pin],
          "model_expert_read_mb_per_token": hp.k * sum(hp.expert_read) / 2**20,
          "expert_read_mb_per_token": halda_moe.expected_read(prof, cpu, res) / 2**20, "resident": res})
  else:
    raise ValueError(f"unknown plan method {method!r}; use halda, memory, equal, single or manual")
  if drop_unused:
    keep = [m for m in range(M) if m == 0 or any(p.windows[m])]
    ex = p.experts and dict(p.experts, resident=[p.experts["resident"][m] for m in keep],
                            expert_pin_mb_per_window=[p.experts["expert_pin_mb_per_window"][m] for m in keep])
    p = dataclasses.replace(p, windows=[p.windows[m] for m in keep], n_gpu=tuple(p.n_gpu[m] for m in keep),
                            residency=None if p.residency is None else tuple(p.residency[m] for m in keep),
                            experts=ex)
    specs = [specs[m] for m in keep]
  return p, list(specs)
