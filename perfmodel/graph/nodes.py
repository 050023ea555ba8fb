"""The execution graph of one per-device program: the seam shared by prediction and emulation.

A graph is a set of *regions* (the entry computation, every loop body and every branch of a conditional), each a
list of nodes in program order (a compiled module is scheduled, so text order is issue order), with data
dependencies between nodes of the same region. A ``loop`` node stands for a whole nested region executed
``trip_count`` times (``compiled.cost_analysis()`` counts a loop body once; this graph does not).

Node kinds (``Node.kind``):
  * ``dot``        a matmul (a bare ``dot``, or a library fusion / custom-call around one)
  * ``fusion``     any other fusion / elementwise / reduce / copy-like work (priced by bytes + flops)
  * ``collective`` all-reduce, all-gather, reduce-scatter, all-to-all, collective-broadcast
  * ``p2p``        collective-permute / send / recv
  * ``wait``       the ``*-done`` half of an async pair (``Node.start`` = id of its start node)
  * ``loop``       a while loop / call (``Node.body``, ``Node.trip_count``) or a conditional (``Node.branches``)
  * ``other``      custom-calls and ops with no cost model
Three builders make one: perfmodel/graph/from_hlo.py (a compiled program), from_jaxpr.py (a per-rank jaxpr) and
analytic.py (no program at all).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, Optional

from perfmodel.graph import replica_groups as rg

COMPUTE_KINDS = ("dot", "fusion", "other")


@dataclasses.dataclass(frozen=True)
class Attribution:
  op_name: str = ""  # jax op_name path, e.g. 'jit(step)/transpose(jvp(Transformer))/layers/mlp/dot_general'
  source: str = ""  # 'file:line (function)'
  phase: str = "fwd"  # fwd | bwd | opt
  layer: str = ""  # 'layers' (scanned stack), 'layers_3', 'embed', 'lm_head', ... from the op_name
  op: str = ""  # last primitive name in op_name


@dataclasses.dataclass(frozen=True)
class CollectiveInfo:
  kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute | ...
  group_size: int
  n_groups: int
  bytes: float  # payload S in the alpha-beta formulas: the full (unsharded) buffer of the operation
  groups_text: str = ""  # raw replica_groups / source_target_pairs text (expand with groups())
  channel_id: int = -1
  is_async: bool = False
  n_devices: int = 1
  ring: int = 0  # a windowed einsum's ring transfer: its direction (+1 / -1), each direction on its own links

  def groups(self) -> list:
    return list(parse_groups(self.kind, self.groups_text, self.n_devices))


@functools.lru_cache(maxsize=512)
def parse_groups(kind: str, text: str, n_devices: int) -> tuple:
  """A collective's device groups from its replica_groups (a collective-permute's: its source-target pairs) text.
  Cached: a program repeats the same groups in every layer and loop body, a loop body's collectives are priced
  once per trip and schedule slot, and the groups of thousands of devices take a second to parse."""
  if kind == "collective-permute":
    return tuple(rg.parse_pairs(text))
  return tuple(rg.parse_replica_groups(text or None, n_devices))


@dataclasses.dataclass(frozen=True)
class DotInfo:
  m: int
  n: int
  k: int
  batch: int
  dtype: str  # the result's
  in_dtype: str = ""  # the operands' (what the matrix unit runs at: a bf16 x bf16 dot may write f32)
  # a fused attention kernel (cuDNN flash attention): 'attention_fwd' / 'attention_bwd' ('_causal' under a causal
  # mask) and its key/value sequence length, priced by the profile's attention curves where it has them
  kernel: str = ""
  seq: int = 0


@dataclasses.dataclass(frozen=True)
class Node:
  id: int
  name: str  # HLO instruction name (unique within the module)
  kind: str
  opcode: str  # HLO opcode, with fusion kind for fusions ('fusion:kLoop')
  flops: float = 0.0
  transcendentals: float = 0.0
  bytes: float = 0.0  # bytes read + written at the node boundary (HloCostAnalysis convention)
  out_bytes: float = 0.0
  deps: tuple = ()  # ids of nodes in the same region this one reads
  attribution: Attribution = Attribution()
  collective: Optional[CollectiveInfo] = None
  dot: Optional[DotInfo] = None
  body: str = ""  # loop: region name
  trip_count: int = 1
  start: int = -1  # wait: id of the matching start node
  fingerprint: str = ""  # shape/op signature for the profiled database
  # conditional: every branch region, indexed like lax.switch (a pred conditional: [false, true]), and the
  # expected executions of each per visit once resolved (perfmodel/pipeline.py); () = not resolved
  branches: tuple = ()
  branch_weights: tuple = ()
  # bytes moved by the distinct compute nodes of the whole program this node belongs to (its working set
  # context: on a CPU a node runs slower per byte inside a program that streams more; perfmodel/cost/learned.py)
  program_bytes: float = 0.0
  # a layout change (copy/transpose, alone or fused) that moves the minor-most dimension: every element is
  # gathered with a stride instead of copied in contiguous runs (measured on a CPU: 2-4.5x slower per byte than a
  # layout change that keeps it)
  moves_minor: bool = False
  # only picks or stores one layer's (one tick's) slice of a stacked array (perfmodel/graph/movement.py indexes)
  indexing: bool = False
  # inside a sampler's decode loop (set by :func:`mark_decode`): one token per sequence per trip, the weights and
  # KV cache hot from the previous trip: neighbours of its class from training steps overprice such nodes 1.2-2.4x,
  # so the fitted backends price them from sampler programs
  decode: bool = False


@dataclasses.dataclass
class Region:
  name: str
  nodes: list  # list[Node] in program order


@dataclasses.dataclass
class ExecGraph:
  regions: dict  # name -> Region
  entry: str
  n_devices: int
  module_name: str = ""

  def walk(self, region: Optional[str] = None, mult: float = 1) -> Iterator:
    """Yields (node, multiplicity) over every node, descending into loops (multiplicity = trip product).
    A resolved conditional contributes each branch times its expected executions (a float); an unresolved
    one its first branch."""
    for n in self.regions[region or self.entry].nodes:
      yield n, mult
      if n.kind == "loop" and n.branch_weights:
        for br, w in zip(n.branches, n.branch_weights):
          if w:
            yield from self.walk(br, mult * n.trip_count * w)
      elif n.kind == "loop":
        yield from self.walk(n.body, mult * n.trip_count)

  def totals(self) -> dict:
    out = {"flops": 0.0, "transcendentals": 0.0, "bytes": 0.0, "collective_bytes": 0.0, "n_nodes": 0}
    kinds = {}
    for n, k in self.walk():
      out["flops"] += n.flops * k
      out["transcendentals"] += n.transcendentals * k
      out["bytes"] += n.bytes * k
      out["n_nodes"] += k
      if n.collective:
        out["collective_bytes"] += n.collective.bytes * k
      kinds[n.kind] = kinds.get(n.kind, 0) + k
    out["node_counts"] = kinds
    return out

  def collectives(self) -> list:
    return [(n, k) for n, k in self.walk() if n.collective is not None]

  def to_dict(self) -> dict:
    return {"entry": self.entry, "n_devices": self.n_devices, "module": self.module_name,
            "regions": {r: [dataclasses.asdict(n) for n in reg.nodes] for r, reg in self.regions.items()}}



def mark_program_bytes(g: ExecGraph) -> float:
  """Sets every compute node's ``program_bytes``: the bytes of the program's distinct compute nodes (each
  instruction once, whatever its trip count, branches included). Returns that sum."""
  total = float(sum(n.bytes for reg in g.regions.values() for n in reg.nodes if n.kind in COMPUTE_KINDS))
  for reg in g.regions.values():
    reg.nodes = [dataclasses.replace(n, program_bytes=total) if n.kind in COMPUTE_KINDS else n for n in reg.nodes]
  return total


def mark_decode(g: ExecGraph, region: Optional[str]) -> None:
  """Flags every node of ``region`` (a sampler's decode loop body) and of the regions it runs as ``decode``."""
  if not region:
    return
  todo, seen = [region], set()
  while todo:
    r = todo.pop()
    if r in seen or r not in g.regions:
      continue
    seen.add(r)
    reg = g.regions[r]
    reg.nodes = [n if n.decode else dataclasses.replace(n, decode=True) for n in reg.nodes]
    for n in reg.nodes:
      todo.extend([n.body] if n.body else [])
      todo.extend(n.branches)

