"""Latency-bandwidth (alpha-beta) models of collectives over a hardware profile's link levels.

Shared by prediction and emulation: both price a collective node here. S is the payload in bytes
(the full buffer: the all-reduce operand, the all-gather result, the reduce-scatter operand), n the
group size, B the per-device one-direction bandwidth of the level, alpha its per-step latency.

  ring all-reduce      2(n-1)/n * S/B + 2(n-1) alpha
  tree all-reduce      2 S/B + 2 ceil(log2 n) alpha          (pipelined double binary tree)
  ring all-gather / reduce-scatter   (n-1)/n * S/B + (n-1) alpha
  all-to-all           (n-1)/n * S/B_bisection + (n-1) alpha
  collective-permute   S/B + alpha
  hierarchical         groups spanning several domains of the innermost level: reduce-scatter inside
                       the domain, all-reduce of S/n_inner across domains, all-gather inside.
Torus levels run bidirectional rings on every torus dimension: effective B = 2 * dims * link B.
A combined (tuple) call of several buffers: :func:`combined_cost` (per buffer on XLA:CPU, one launch elsewhere).

Which devices share a domain: device ids are assumed numbered so that ``id // level.size`` is the
domain (meshes put the tensor axis innermost, so tensor groups land inside NVLink islands).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from perfmodel.hardware import HardwareProfile, LinkLevel, interp_log


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
  seconds: float
  algorithm: str  # ring | tree | hierarchical | direct | measured
  level: str  # link level(s) used


def _eff_bw(level: LinkLevel) -> float:
  dims = {"torus2d": 2, "torus3d": 3}.get(level.topology)
  return level.bandwidth * 2 * dims if dims else level.bandwidth


def ring_all_reduce(S: float, n: int, B: float, alpha: float) -> float:
  return 0.0 if n <= 1 else 2 * (n - 1) / n * S / B + 2 * (n - 1) * alpha


def tree_all_reduce(S: float, n: int, B: float, alpha: float) -> float:
  return 0.0 if n <= 1 else 2 * S / B + 2 * math.ceil(math.log2(n)) * alpha


def ring_all_gather(S: float, n: int, B: float, alpha: float) -> float:
  """Also reduce-scatter (same volume, reversed)."""
  return 0.0 if n <= 1 else (n - 1) / n * S / B + (n - 1) * alpha


def all_to_all(S: float, n: int, B: float, alpha: float) -> float:
  return 0.0 if n <= 1 else (n - 1) / n * S / B + (n - 1) * alpha


def permute(S: float, B: float, alpha: float) -> float:
  return S / B + alpha


def _flat(kind: str, S: float, n: int, level: LinkLevel, algorithm: str) -> tuple:
  B, a = _eff_bw(level), level.latency
  if kind == "all-reduce":
    ring, tree = ring_all_reduce(S, n, B, a), tree_all_reduce(S, n, B, a)
    if algorithm == "ring" or (algorithm == "auto" and ring <= tree):
      return ring, "ring"
    return tree, "tree"
  if kind in ("all-gather", "reduce-scatter", "collective-broadcast"):
    return ring_all_gather(S, n, B, a), "ring"
  if kind in ("all-to-all", "ragged-all-to-all"):
    # A fat-tree/switch has full bisection; a torus ring's bisection is ~n/4 links of the dimension.
    Bb = B if level.topology in ("switch", "fat-tree") else B * 4 / max(4, n)
    return all_to_all(S, n, Bb, a), "direct"
  if kind == "collective-permute":
    return permute(S, B, a), "direct"
  raise ValueError(f"no model for collective {kind!r}")


def domains_spanned(group, level_size: int) -> tuple:
  """(devices per domain, number of domains) of a device group at a level of `level_size`."""
  if level_size <= 0:
    return len(group), 1
  doms = {}
  for d in group:
    doms[d // level_size] = doms.get(d // level_size, 0) + 1
  return max(doms.values()), len(doms)


def _measured_scale(kind: str, n: int) -> float:
  """Curves are calibrated on this host for n=2; scale them like a ring's bandwidth term for larger groups."""
  return {"all-reduce": (2 * (n - 1) / n) / 1.0, "all-gather": ((n - 1) / n) / 0.5,
          "reduce-scatter": ((n - 1) / n) / 0.5}.get(kind, 1.0)


def cost(kind: str, S: float, group: tuple, hw: HardwareProfile, algorithm: str = "auto") -> CollectiveCost:
  """Time of one collective for one group (all groups of a node run in parallel on disjoint devices)."""
  n = len(group)
  if n <= 1 or S <= 0:
    return CollectiveCost(0.0, "none", "")
  measured = hw.collective_curve.get(kind) if hw.collective_curve else None
  if measured:
    return CollectiveCost(interp_log(measured, S) * _measured_scale(kind, n), "measured", "loopback")
  levels = list(hw.links) or [LinkLevel("none", 0, float("inf"), 0.0)]
  inner = levels[0]
  per_dom, n_dom = domains_spanned(group, inner.size)
  if n_dom == 1 or len(levels) == 1:
    t, alg = _flat(kind, S, n, inner, algorithm)
    return CollectiveCost(t, alg, inner.name)
  outer = levels[1]
  if kind == "all-reduce":
    t = (ring_all_gather(S, per_dom, _eff_bw(inner), inner.latency) * 2  # RS + AG inside the domain
         + _flat("all-reduce", S / per_dom, n_dom, outer, algorithm)[0])
  elif kind in ("all-gather", "reduce-scatter"):
    t = (ring_all_gather(S / n_dom, per_dom, _eff_bw(inner), inner.latency)
         + ring_all_gather(S, n_dom, _eff_bw(outer), outer.latency))
  else:
    t = _flat(kind, S, n, outer, algorithm)[0]  # a2a / permute across domains: bound by the outer level
  return CollectiveCost(t, "hierarchical", f"{inner.name}+{outer.name}")


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a compiled program's partitions sit (perfmodel/program.py builds it from the compile-only devices):
  per partition id, (domain, *position): the domain is the outer level's unit (TPU slice, GPU node), the position
  the chip's torus coordinates (TPU; ``shape`` the slice's torus and ``wrap`` which of its axes close into rings)
  or its index in the node (GPU; ``shape`` empty: a switch)."""
  coords: tuple
  shape: tuple = ()
  wrap: tuple = ()


# Link efficiency where a profile publishes no curve for a level: the datasheet rate (named in `assumptions`).
ASSUMED_LINK_EFFICIENCY = 1.0
FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
          "reduce-scatter": lambda n: (n - 1) / n, "collective-broadcast": lambda n: (n - 1) / n}


def _curve(hw: HardwareProfile, group: str, kind: str, level: LinkLevel):
  c = (hw.efficiency or {}).get(group, {}).get(kind)
  if not c or c.get("level", level.name) != level.name:
    return None
  scale = level.bandwidth if c.get("unit") == "busbw_fraction" else 1.0
  return lambda S: interp_log(c["value"], S) * scale  # busbw, bytes/s


def _inner_time(kind: str, S: float, members: list, hw: HardwareProfile, pl: Placement, notes: set) -> float:
  """One domain's part of a collective: NVLink/switch from the published busbw curve of the kind (the sizes it
  was measured at, never under the ring's latency term; alpha-beta elsewhere), a TPU torus as bidirectional rings on every axis the group spans
  (one direction where the axis does not wrap), links at the published permute efficiency."""
  n, lv = len(members), hw.links[0]
  if n <= 1 or S <= 0:
    return 0.0
  if not pl.shape:  # switch
    busbw = _curve(hw, "collectives", kind, lv)
    if busbw is not None and kind in FACTOR:
      # never under the ring's latency term: the curve clamps its busbw below the smallest measured size,
      # where a collective is latency-bound (the level's latency is derived from such a measurement)
      return max(FACTOR[kind](n) * S / busbw(S), _flat(kind, 0.0, n, lv, "ring")[0])
    notes.add(f"{kind} on {lv.name}: alpha-beta from the datasheet link rate (no published curve)")
    return _flat(kind, S, n, lv, "auto")[0]
  extents = [len({c[1 + a] for c in members}) for a in range(len(pl.shape))]
  rings = [(e, 2 if pl.wrap[a] and e == pl.shape[a] else 1) for a, e in enumerate(extents) if e > 1]
  permute = _curve(hw, "collectives", "collective-permute", lv)
  if permute is not None:
    eff = min(1.0, permute(S / n) / lv.bandwidth)
  else:
    eff = ASSUMED_LINK_EFFICIENCY
    notes.add(f"{lv.name}: datasheet link rate x {ASSUMED_LINK_EFFICIENCY} (no published collective curve)")
  bw = lv.bandwidth * eff * max(1, sum(d for _, d in rings))
  hops = sum(e - 1 for e, _ in rings) * lv.latency
  if kind in FACTOR:
    return FACTOR[kind](n) * S / bw + hops * (2 if kind == "all-reduce" else 1)
  if kind == "collective-permute":
    return S / (lv.bandwidth * eff) + lv.latency
  return all_to_all(S, n, bw * 4 / max(4, n), lv.latency)  # torus bisection ~ n/4 links of a ring


def placed_cost(kind: str, S: float, group: tuple, hw: HardwareProfile, pl: Placement,
                notes: Optional[set] = None) -> CollectiveCost:
  """A collective of a program compiled for the target: the group's devices located by ``pl``. Inside one
  domain :func:`_inner_time`; across domains (InfiniBand between nodes, DCN between TPU slices) hierarchical:
  reduce-scatter inside each domain, the outer level's collective of S / devices-per-domain (alpha-beta at its
  datasheet rate x the published outer busbw fraction where there is one; an all-reduce as a ring or a tree,
  whichever is faster), all-gather inside."""
  notes = set() if notes is None else notes
  members = [pl.coords[d] for d in group if d < len(pl.coords)]
  doms = {}
  for c in members:
    doms.setdefault(c[0], []).append(c)
  one = next(iter(doms.values()), [])
  if len(doms) <= 1 or len(hw.links) < 2:
    return CollectiveCost(_inner_time(kind, S, one, hw, pl, notes), "placed", hw.links[0].name)
  outer, n_dom, per = hw.links[1], len(doms), len(one)
  frac = _curve(hw, "collectives_outer", kind, outer)
  out_lv = dataclasses.replace(outer, bandwidth=frac(S / per) if frac else outer.bandwidth)
  if frac is None:
    notes.add(f"{kind} on {outer.name}: alpha-beta from the datasheet rate (no published curve)")
  if kind == "all-reduce":
    # across domains ring or double binary tree, whichever the alpha-beta model finds faster (NCCL's tuner
    # chooses the same way: a small all-reduce over hundreds of nodes pays 2 log2(n) hops, not 2(n-1))
    t = 2 * _inner_time("reduce-scatter", S, one, hw, pl, notes) + _flat("all-reduce", S / per, n_dom, out_lv, "auto")[0]
  elif kind in ("all-gather", "reduce-scatter"):
    # each device exchanges its S / per with its peers of the other domains over its own NIC, then the domain
    # gathers (or, reduce-scatter: the reverse) the whole S inside
    t = _inner_time(kind, S, one, hw, pl, notes) + ring_all_gather(S / per, n_dom, out_lv.bandwidth, out_lv.latency)
  elif kind in ("all-to-all", "ragged-all-to-all"):
    # each device sends S / n to every peer: the blocks for the (per - 1) peers of its own domain go over the
    # inner level, the (n - per) others over its own NIC, both at once (expert-parallel dispatch across nodes)
    n = len(members)
    t = max(_inner_time(kind, S * per / n, one, hw, pl, notes),
            S * (n - per) / n / out_lv.bandwidth + (n - per) * out_lv.latency)
  else:
    t = _flat(kind, S, len(members), out_lv, "auto")[0]
  return CollectiveCost(t, "placed-hierarchical", f"{hw.links[0].name}+{outer.name}")


def call_key(kind: str, sizes) -> str:
  """Key of one (possibly combined) call in ``HardwareProfile.collective_calls``."""
  return kind + "|" + ",".join(str(int(s)) for s in sizes)


def combined_cost(kind: str, sizes, group: tuple, hw: HardwareProfile, algorithm: str = "auto") -> CollectiveCost:
  """One combined call: several collectives of one kind over one group issued together (XLA's combiners
  merge them into one tuple instruction). Payloads ``sizes`` in the :func:`cost` convention.

  XLA:CPU runs a tuple collective as one call of its CPU collectives library (gloo) per operand buffer
  (the all-reduce / all-gather / permute thunks loop over their buffers), so each operand pays its own
  latency. With a measured per-further-operand curve (``collective_next_curve``, from the 2-process
  gloo calibration) the first operand is priced as a lone call (it pays the hand-off between the
  processes) and each further one by that curve; without it, on CPU, each operand as a lone call. NCCL
  and the TPU runtime group a tuple into one launch: priced as one call of the summed payload.
  A call measured as such on this host (``collective_calls``, n=2) takes precedence."""
  sizes = [s for s in sizes if s > 0]
  if not sizes:
    return CollectiveCost(0.0, "none", "")
  exact = hw.collective_calls.get(call_key(kind, sizes)) if hw.collective_calls else None
  if exact is not None and len(group) == 2:
    return CollectiveCost(float(exact), "replayed", "loopback")
  if len(sizes) == 1:
    return cost(kind, sizes[0], group, hw, algorithm)
  if hw.device_kind != "cpu":
    return cost(kind, sum(sizes), group, hw, algorithm)
  first = cost(kind, sizes[0], group, hw, algorithm)
  nxt = hw.collective_next_curve.get(kind) if hw.collective_next_curve else None
  if nxt and first.algorithm == "measured":
    rest = sum(interp_log(nxt, s) for s in sizes[1:]) * _measured_scale(kind, len(group))
    return CollectiveCost(first.seconds + rest, "measured-combined", first.level)
  return CollectiveCost(first.seconds + sum(cost(kind, s, group, hw, algorithm).seconds for s in sizes[1:]),
                        first.algorithm, first.level)


def node_cost(info, hw: HardwareProfile, algorithm: str = "auto", group: Optional[tuple] = None,
              placement: Optional[Placement] = None, notes: Optional[set] = None) -> CollectiveCost:
  """Cost of a graph CollectiveInfo: its first group stands for all (SPMD groups are symmetric); with a
  ``placement`` (a program compiled for the target) by :func:`placed_cost`."""
  if placement is not None and group is None:
    first = info.groups()[0] if info.groups() else tuple(range(info.group_size))
    return placed_cost(info.kind, info.bytes, tuple(first), hw, placement, notes)
  if group is None:
    if info.kind == "collective-permute":
      pairs = info.groups()
      group = tuple(pairs[0]) if pairs else (0, 1)
      return _permute_cost(info.bytes, group, hw)
    group = _first_group(info)
  return cost(info.kind, info.bytes, group, hw, algorithm)


def _first_group(info) -> tuple:
  # Expanding every group of an 8192-device program is wasteful: parse once, keep the first.
  groups = info.groups()
  return tuple(groups[0]) if groups else tuple(range(info.group_size))


def _permute_cost(S, pair, hw) -> CollectiveCost:
  # A curve measured on this host (calibrate: in-process, marginal inside a program; gloo: 2 processes) before
  # the link model: between two virtual devices a permute is a copy and a rendezvous, about 16 us at 64 KB
  # against ~83 us from the cpu profile's link latency and bandwidth.
  if hw.collective_curve and hw.collective_curve.get("collective-permute"):
    return cost("collective-permute", S, tuple(pair), hw)
  levels = list(hw.links)
  if not levels:
    return CollectiveCost(0.0, "none", "")
  lv = levels[0]
  if len(levels) > 1 and lv.size and pair[0] // lv.size != pair[-1] // lv.size:
    lv = levels[1]
  return CollectiveCost(permute(S, _eff_bw(lv), lv.latency), "direct", lv.name)
