"""Halda: layer windows, GPU offload, residency and device selection as a mixed-integer program (after
prima.cpp), with a cost that models the pipelined ring's disk/compute overlap.

For a number of cycles k (L % k == 0, W = L / k layers per ring round) choose per device m
  w_m  integer  layers of each of its k windows             (sum_m w_m = W)
  n_m  integer  of those, layers on the GPU (VRAM-resident)  (n_m <= w_m, n_m <= GPU capacity)
  u_m  binary   device used (head always)                   (u_m <= w_m <= W u_m for non-head devices)
and how each window's CPU bytes s_m = b (w_m - n_m) are kept, per window:
  p_m  pinned (resident all the time)       x_m  prefetched into a buffer during the rest of the ring
  y_m  faulted in synchronously when the window runs (streamed through, not kept)
  s_m = p_m + x_m + y_m,   k p_m + x_m + k kv (w_m - n_m) <= R_m   (pinned for all k windows + one buffer + KV)
with a cycle time T (one trip of the token round the ring):
  T >= sum_m [ c_m (w_m - n_m) + g_m n_m + xi_m u_m + y_m / disk_m ]     the stages run one after another
  T >= c_m (w_m - n_m) + g_m n_m + (x_m + y_m) / disk_m   for every m   device m's disk reads its next
                                                                        window while the others work
minimising the per-token latency  k T + kappa.

Why not prima.cpp's cost. prima.cpp charges a RAM-short device the disk time of its whole excess
(k b' (w - n) - R) / disk as if every read were synchronous, credits nothing for prefetch, and does not
model where the prefetched bytes live. Two consequences, both measured here (README): (1) its cost never
prefers k > 1 for disk reasons (the excess is the same for every k), although overlapping reads with the
other devices' work is the point of the pipelined ring; (2) a k = 1 window larger than RAM that is
prefetched whole evicts its own first pages before they are used (the prefetch-release conflict), so the
device reads it about twice per token while the cost charges the excess once (148 ms predicted vs 373 ms
measured). Here the memory constraint forbids a buffer larger than what RAM leaves, so every plan is
runnable without that conflict, and the two T rows charge what the ring really does: synchronous faults
add to the chain of stages, prefetched reads only have to fit in one cycle. The runtime (device.py)
executes p/x/y exactly as planned. ``prima_cost`` keeps prima.cpp's objective for comparison.

xi_m = activation bytes / link bandwidth + link latency (prima.cpp sets it to 0; we keep it, and it is
what lets device selection drop a badly linked device); a head left working alone sends nothing (binary z). kappa = head-only work (embedding, output).
Solver: scipy.optimize.milp (HiGHS), in ms and MiB (with seconds and bytes HiGHS returned plans a few %
off the optimum). ``evaluate`` computes the same objective for fixed (w, n) by bisection on T, an
independent implementation that the tests compare against the MILP by brute force over (w, n).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional, Sequence

import numpy as np

MiB = float(2**20)


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
  layer_bytes: int  # weights of one layer (file bytes, what is paged in)
  kv_bytes_per_layer: int = 0  # KV cache of one layer at the planned context (anonymous memory)
  head_s: float = 0.0  # embedding + output layer time on the head (kappa)
  # MoE layers (halda_moe.py): the experts' part of layer_bytes, and the expected per-token expert bytes one layer
  # reads with q of its expert bytes resident, as max_i (a_i - s_i q) ((a_i bytes, s_i) pairs). 0 / (): dense.
  expert_bytes: int = 0
  expert_curve: tuple = ()


@dataclasses.dataclass(frozen=True)
class Plan:
  k: int
  w: tuple  # layers per window, per device
  n: tuple  # GPU layers per window, per device
  latency_s: float  # objective value (model of seconds per token)
  used: tuple  # device indices with w > 0
  solver: str = "highs"
  pin: tuple = ()  # bytes per window pinned, per device
  prefetch: tuple = ()  # bytes per window prefetched into the buffer, per device
  sync: tuple = ()  # bytes per window faulted in synchronously, per device
  expert_pin: tuple = ()  # MoE: expert bytes per window kept resident (hottest first), per device
  expert_read: tuple = ()  # MoE: expected expert bytes per window and token read when routed, per device

  def windows(self) -> list:
    """[device][cycle] -> list of layer ids; ring order is device 0..M-1 within each cycle."""
    out = [[] for _ in self.w]
    start = 0
    for _ in range(self.k):
      for m, wm in enumerate(self.w):
        out[m].append(list(range(start, start + wm)))
        start += wm
    return out

  def disk_bytes_per_token(self) -> float:
    return float(sum(self.k * (x + y) for x, y in zip(self.prefetch, self.sync)) + self.k * sum(self.expert_read))


def _ram_left(d: DeviceCost, model: ModelCost, k: int, cpu_layers: int) -> float:
  return d.ram_bytes - k * model.kv_bytes_per_layer * cpu_layers


def residency(d: DeviceCost, model: ModelCost, k: int, w: int, n: int, budget_s: float) -> Optional[tuple]:
  """Fewest synchronous bytes for one device whose disk may spend ``budget_s`` per cycle on its reads:
  (pin, prefetch, sync) bytes per window, or None if impossible. Used by ``evaluate`` (not by the MILP)."""
  s = model.layer_bytes * (w - n)
  r = _ram_left(d, model, k, w - n)
  if r < 0 or budget_s < 0:
    return None
  if s == 0:
    return 0.0, 0.0, 0.0
  readable = d.disk_Bps * budget_s if math.isfinite(d.disk_Bps) else math.inf
  p = max(0.0, s - readable)  # whatever the disk cannot read within the cycle must be pinned
  if k * p > r + 1e-9:
    return None
  x = min(r - k * p, s - p)  # buffer what RAM leaves (pinning more would only cost more sync reads for k > 1)
  if k == 1:  # for k = 1 pinning and buffering cost the same RAM: pin it all (fewest bytes read)
    p, x = min(s, r), 0.0
    if s - p > readable + 1e-9:
      return None
  return p, x, s - p - x


def evaluate(devs: Sequence[DeviceCost], model: ModelCost, k: int, w: Sequence[int], n: Sequence[int]) -> float:
  """Halda's objective for a fixed assignment (seconds per token; inf if infeasible), by bisection on T.
  Dense layers only (MoE plans: ``halda_moe.one_device_latency`` checks the MILP)."""
  if model.expert_bytes:
    raise ValueError("halda.evaluate models dense layers; for MoE costs use halda.solve_k")
  used = [m for m, wm in enumerate(w) if wm > 0 or m == 0]
  comp = {m: devs[m].t_cpu_layer_s * (w[m] - n[m]) + devs[m].t_gpu_layer_s * n[m] for m in used}
  # every used device sends once per cycle; a head that works alone sends nothing
  chain = sum(comp[m] + (devs[m].link_s if len(used) > 1 else 0.0) for m in used)

  def sync_time(T):
    tot = 0.0
    for m in used:
      r = residency(devs[m], model, k, w[m], n[m], T - comp[m])
      if r is None:
        return math.inf
      tot += r[2] / devs[m].disk_Bps if r[2] else 0.0
    return tot

  lo, hi = chain, chain + sum(model.layer_bytes * (w[m] - n[m]) / devs[m].disk_Bps for m in used
                             if math.isfinite(devs[m].disk_Bps)) + 1.0
  if not math.isfinite(sync_time(hi)) or chain + sync_time(hi) > hi:
    return math.inf
  for _ in range(200):  # f(T) = chain + sync(T) - T is decreasing: find its root (or chain if none)
    mid = 0.5 * (lo + hi)
    if chain + sync_time(mid) <= mid:
      hi = mid
    else:
      lo = mid
  return k * hi + model.head_s


def prima_cost(devs: Sequence[DeviceCost], model: ModelCost, k: int, w: Sequence[int], n: Sequence[int]) -> float:
  """prima.cpp's objective (every excess byte read synchronously, no overlap), for comparison."""
  bp = model.layer_bytes + model.kv_bytes_per_layer
  t = model.head_s
  for m, (d, wm, nm) in enumerate(zip(devs, w, n)):
    if wm == 0 and m:
      continue
    t += k * d.t_cpu_layer_s * (wm - nm) + k * d.t_gpu_layer_s * nm + k * d.link_s
    t += max(0.0, k * bp * (wm - nm) - d.ram_bytes) / d.disk_Bps
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
  bE = model.expert_bytes / MiB
  b, kv = model.layer_bytes / MiB - bE, model.kv_bytes_per_layer / MiB  # b: the bytes every token reads
  big = 1e9  # "infinite" RAM / disk in MiB, MiB/ms
  # variable order: w, n, u, p, x, y (M each), then T (ms), then z (binary: any device besides the head used),
  # then for MoE layers q (resident expert MiB per window) and e (expected expert MiB read per window and token)
  iw, i_n, iu, ip, ix, iy, iT, iz = 0, M, 2 * M, 3 * M, 4 * M, 5 * M, 6 * M, 6 * M + 1
  moe = bE > 0
  iq, ie = 6 * M + 2, 7 * M + 2
  nv = 6 * M + 2 + (2 * M if moe else 0)
  cpu = [1e3 * d.t_cpu_layer_s for d in devs]
  gpu = [1e3 * d.t_gpu_layer_s for d in devs]
  inv_disk = [1e3 * MiB / d.disk_Bps if math.isfinite(d.disk_Bps) else 0.0 for d in devs]  # ms per MiB
  c = np.zeros(nv)
  c[iT] = k
  for m in range(M):  # tie-break: among equal latencies, read less from disk
    c[ix + m] = c[iy + m] = 1e-7 * k
    if moe:
      c[ie + m] = 1e-7 * k
  rows, lo, hi = [], [], []

  def add(coefs: dict, lb: float, ub: float):
    r = np.zeros(nv)
    for j, v in coefs.items():
      r[j] = r[j] + v
    rows.append(r)
    lo.append(lb)
    hi.append(ub)

  add({iw + m: 1.0 for m in range(M)}, W, W)
  chain = {iT: -1.0}
  for m, d in enumerate(devs):
    add({i_n + m: 1.0, iw + m: -1.0}, -np.inf, 0.0)  # n <= w
    add({iw + m: 1.0, iu + m: -float(W)}, -np.inf, 0.0)  # w <= W u
    if m:  # a used non-head device computes something; the head may hold only embedding/output
      add({iw + m: 1.0, iu + m: -1.0}, 0.0, np.inf)
    add({iw + m: b, i_n + m: -b, ip + m: -1.0, ix + m: -1.0, iy + m: -1.0}, 0.0, 0.0)  # s = p + x + y
    ram = d.ram_bytes / MiB if math.isfinite(d.ram_bytes) else big
    add({ip + m: float(k), ix + m: 1.0, iw + m: k * kv, i_n + m: -k * kv, **({iq + m: float(k)} if moe else {})},
        -np.inf, ram)
    own = {iw + m: cpu[m], i_n + m: gpu[m] - cpu[m]}
    for j, v in own.items():
      chain[j] = chain.get(j, 0.0) + v
    link_var = iz if m == 0 else iu + m  # the head's hop exists only in a ring of two or more
    chain[link_var] = chain.get(link_var, 0.0) + 1e3 * d.link_s
    chain[iy + m] = chain.get(iy + m, 0.0) + inv_disk[m]
    disk = {ix + m: inv_disk[m], iy + m: inv_disk[m]}
    if moe:  # routed experts are read when the router has chosen them: synchronously, in the chain
      chain[ie + m] = inv_disk[m]
      disk[ie + m] = inv_disk[m]
      add({iq + m: 1.0, iw + m: -bE, i_n + m: bE}, -np.inf, 0.0)  # q <= bE (w - n)
      for a, sl in model.expert_curve:  # e >= a (w - n) - s q  (the perspective of the convex per-layer curve)
        add({ie + m: 1.0, iw + m: -a / MiB, i_n + m: a / MiB, iq + m: float(sl)}, 0.0, np.inf)
    add({**own, **disk, iT: -1.0}, -np.inf, 0.0)
  add(chain, -np.inf, 0.0)
  lb = np.zeros(nv)
  ub = np.full(nv, np.inf)
  for m, d in enumerate(devs):
    ub[iw + m] = W
    ub[i_n + m] = min(W, _gpu_cap(d, model, k))
    ub[iu + m] = 1
  lb[iu + 0] = 1  # the head holds embedding/output and drives the ring
  ub[iz] = 1
  for m in range(1, M):  # z >= u_m: any used non-head device makes the head send
    add({iz: 1.0, iu + m: -1.0}, 0.0, np.inf)
  integrality = np.zeros(nv)
  integrality[iw:ip] = 1
  integrality[iz] = 1
  res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
             bounds=Bounds(lb, ub), options={"mip_rel_gap": 1e-9})
  if res.status != 0 or res.x is None:
    return None
  x = res.x
  w = tuple(int(round(v)) for v in x[iw:iw + M])
  n = tuple(int(round(v)) for v in x[i_n:i_n + M])
  get = lambda i: tuple(float(max(0.0, v)) * MiB for v in x[i:i + M])  # noqa: E731
  lat = k * float(x[iT]) / 1e3 + model.head_s
  return Plan(k, w, n, lat, tuple(m for m in range(M) if w[m] > 0), pin=get(ip), prefetch=get(ix), sync=get(iy),
              expert_pin=get(iq) if moe else (), expert_read=get(ie) if moe else ())


def solve(devs: Sequence[DeviceCost], model: ModelCost, ks: Optional[Sequence[int]] = None) -> Plan:
  """Best plan over k (default: every divisor of L up to L/2, and 1)."""
  L = model.n_layers
  ks = ks or [k for k in range(1, max(1, L // 2) + 1) if L % k == 0]
  plans = [p for p in (solve_k(devs, model, k) for k in ks) if p is not None]
  if not plans:
    raise ValueError("Halda found no feasible plan: add devices or memory, or lower the context")
  return min(plans, key=lambda p: (round(p.latency_s, 9), p.disk_bytes_per_token(), p.k))


def brute_force(devs: Sequence[DeviceCost], model: ModelCost, k: int) -> tuple:
  """Exhaustive minimum of ``evaluate`` for tiny instances (tests): returns (latency, w, n)."""
  L, M = model.n_layers, len(devs)
  W = L // k
  best = (math.inf, None, None)
  for w in itertools.product(range(W + 1), repeat=M):
    if sum(w) != W:
      continue
    ranges = [range(min(wm, _gpu_cap(d, model, k)) + 1) for d, wm in zip(devs, w)]
    for n in itertools.product(*ranges):
      t = evaluate(devs, model, k, w, n)
      if t < best[0] - 1e-12:
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
