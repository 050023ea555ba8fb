"""Halda: layer windows, GPU offload and device selection as a mixed-integer program (after prima.cpp).

For a number of cycles k (L % k == 0, W = L / k layers per ring round) choose per device m
  w_m  integer  layers of each of its k windows        (sum_m w_m = W)
  n_m  integer  of those, layers on the GPU            (n_m <= w_m, n_m <= GPU capacity)
  u_m  binary   device used (head always)              (w_m <= W u_m)
  e_m  >= 0     bytes read from disk per token          (e_m >= k b' (w_m - n_m) - R_m)
minimising the per-token latency (seconds)

  sum_m [ k t_cpu,m (w_m - n_m) + k t_gpu,m n_m + e_m / s_disk,m + k xi_m u_m ] + kappa

where R_m is RAM left for weights, b' = weight + KV bytes per layer, xi_m = activation bytes / link
bandwidth + link latency (prima.cpp sets it to 0; we keep it, which is what lets device selection
drop a slow-linked device), and kappa = head-only work (embedding, output layer).

Relation to prima.cpp: prima.cpp assigns each device to a set (M1-M4: "RAM short" or "fits") and
charges disk time on the whole window for short devices, crediting back the RAM-resident part in
kappa, with constraints that keep each device consistent with its set; it then iterates the set
assignment. Taking the minimum over set assignments of that cost is exactly the convex max(0, .)
excess term above, so this single MILP solves what prima's loop searches for. Device selection, which
prima does by dropping devices with w <= 1 and re-solving, is the binary u_m. k is enumerated outside.
Solver: scipy.optimize.milp (HiGHS).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class DeviceCost:
  """What Halda needs to know about one device (from the profiler or a devices file)."""
  name: str
  t_cpu_layer_s: float  # compute time of one layer on the CPU
  ram_bytes: float  # memory available for weights + KV (after compute buffers)
  disk_Bps: float  # read throughput for mmap faults / prefetch
  t_gpu_layer_s: float = 0.0  # 0 -> no GPU
  vram_bytes: float = 0.0
  link_s: float = 0.0  # xi: per-hop activation transfer + latency, seconds


@dataclasses.dataclass(frozen=True)
class ModelCost:
  n_layers: int
  layer_bytes: int  # weights of one layer
  kv_bytes_per_layer: int = 0  # KV cache of one layer at the planned context
  head_s: float = 0.0  # embedding + output layer time on the head (kappa)


@dataclasses.dataclass(frozen=True)
class Plan:
  k: int
  w: tuple  # layers per window, per device
  n: tuple  # GPU layers per window, per device
  latency_s: float  # objective value (model of seconds per token)
  used: tuple  # device indices with w > 0
  solver: str = "highs"

  def windows(self) -> list:
    """[device][cycle] -> list of layer ids; ring order is device 0..M-1 within each cycle."""
    out = [[] for _ in self.w]
    start = 0
    for _ in range(self.k):
      for m, wm in enumerate(self.w):
        out[m].append(list(range(start, start + wm)))
        start += wm
    return out


def latency(devs: Sequence[DeviceCost], model: ModelCost, k: int, w: Sequence[int], n: Sequence[int]) -> float:
  """The objective for a given assignment (used by brute force and to score baselines)."""
  bp = model.layer_bytes + model.kv_bytes_per_layer
  t = model.head_s
  for d, wm, nm in zip(devs, w, n):
    if wm == 0 and d is not devs[0]:
      continue
    t += k * d.t_cpu_layer_s * (wm - nm) + k * d.t_gpu_layer_s * nm + k * d.link_s
    excess = max(0.0, k * bp * (wm - nm) - d.ram_bytes)
    t += excess / d.disk_Bps
  return t


def _gpu_cap(d: DeviceCost, model: ModelCost, k: int) -> int:
  if d.t_gpu_layer_s <= 0 or d.vram_bytes <= 0:
    return 0
  return int(d.vram_bytes // (k * (model.layer_bytes + model.kv_bytes_per_layer)))


def solve_k(devs: Sequence[DeviceCost], model: ModelCost, k: int) -> Optional[Plan]:
  """Optimal plan for a fixed k (None if infeasible). Device 0 is the head and is always used."""
  from scipy.optimize import Bounds, LinearConstraint, milp
  L, M = model.n_layers, len(devs)
  if L % k:
    raise ValueError(f"k={k} must divide n_layers={L}")
  W = L // k
  # Scaled to milliseconds and MiB: with seconds and bytes the coefficients span 1e-8..1e6 and HiGHS
  # returned plans a few % off the optimum (caught by the brute-force test).
  MiB = float(2**20)
  bp = (model.layer_bytes + model.kv_bytes_per_layer) / MiB
  # variable order: w (M), n (M), u (M), e (M, MiB read from disk per token)
  iw, i_n, iu, ie = 0, M, 2 * M, 3 * M
  nv = 4 * M
  c = np.zeros(nv)
  for m, d in enumerate(devs):
    c[iw + m] = 1e3 * k * d.t_cpu_layer_s
    c[i_n + m] = 1e3 * k * (d.t_gpu_layer_s - d.t_cpu_layer_s)
    c[iu + m] = 1e3 * k * d.link_s
    c[ie + m] = 1e3 * MiB / d.disk_Bps
  rows, lo, hi = [], [], []

  def add(coefs: dict, lb: float, ub: float):
    r = np.zeros(nv)
    for j, v in coefs.items():
      r[j] = v
    rows.append(r)
    lo.append(lb)
    hi.append(ub)

  add({iw + m: 1.0 for m in range(M)}, W, W)
  for m, d in enumerate(devs):
    add({i_n + m: 1.0, iw + m: -1.0}, -np.inf, 0.0)  # n <= w
    add({iw + m: 1.0, iu + m: -float(W)}, -np.inf, 0.0)  # w <= W u
    if m:  # a used non-head device computes something; the head may hold only embedding/output
      add({iw + m: 1.0, iu + m: -1.0}, 0.0, np.inf)
    # e >= k b' (w - n) - R   <=>   k b' w - k b' n - e <= R
    add({iw + m: k * bp, i_n + m: -k * bp, ie + m: -1.0}, -np.inf, d.ram_bytes / MiB)
  lb = np.zeros(nv)
  ub = np.full(nv, np.inf)
  for m, d in enumerate(devs):
    ub[iw + m] = W
    ub[i_n + m] = min(W, _gpu_cap(d, model, k))
    ub[iu + m] = 1
  lb[iu + 0] = 1  # the head holds embedding/output and drives the ring
  integrality = np.ones(nv)
  integrality[ie:ie + M] = 0
  res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
             bounds=Bounds(lb, ub), options={"mip_rel_gap": 1e-9})
  if res.status != 0 or res.x is None:
    return None
  x = np.round(res.x).astype(int)
  w, n = tuple(int(v) for v in x[iw:iw + M]), tuple(int(v) for v in x[i_n:i_n + M])
  return Plan(k, w, n, latency(devs, model, k, w, n), tuple(m for m in range(M) if w[m] > 0))


def solve(devs: Sequence[DeviceCost], model: ModelCost, ks: Optional[Sequence[int]] = None) -> Plan:
  """Best plan over k (default: every divisor of L up to L/2, and 1)."""
  L = model.n_layers
  ks = ks or [k for k in range(1, max(1, L // 2) + 1) if L % k == 0]
  plans = [p for p in (solve_k(devs, model, k) for k in ks) if p is not None]
  if not plans:
    raise ValueError("Halda found no feasible plan: add devices or memory, or lower the context")
  return min(plans, key=lambda p: (round(p.latency_s, 12), p.k))


def brute_force(devs: Sequence[DeviceCost], model: ModelCost, k: int) -> tuple:
  """Exhaustive minimum for tiny instances (tests): returns (latency, w, n)."""
  L, M = model.n_layers, len(devs)
  W = L // k
  best = (math.inf, None, None)
  for w in itertools.product(range(W + 1), repeat=M):
    if sum(w) != W:
      continue
    ranges = [range(min(wm, _gpu_cap(d, model, k)) + 1) for d, wm in zip(devs, w)]
    for n in itertools.product(*ranges):
      t = latency(devs, model, k, w, n)
      if t < best[0] - 1e-15:
        best = (t, w, n)
  return best


# ------------------------------------------------------------------ baselines for experiments

def memory_proportional(devs: Sequence[DeviceCost], L: int) -> tuple:
  """exo-like split: layers proportional to RAM (largest remainder), one window per device (k=1)."""
  ram = np.array([d.ram_bytes for d in devs], float)
  share = ram / ram.sum() * L
  w = np.floor(share).astype(int)
  for m in np.argsort(-(share - w))[: L - w.sum()]:
    w[m] += 1
  return tuple(int(v) for v in w)


def equal_split(M: int, L: int) -> tuple:
  """dllama-like split: equal layers per device."""
  return tuple(L // M + (1 if m < L % M else 0) for m in range(M))
