"""Event timeline of one region of an execution graph: a compute stream and a communication stream.

List scheduling in program order (the module is scheduled, so text order is the issue order):
  * compute node (dot, fusion, other): starts when the compute stream is free and its inputs exist;
  * synchronous collective: blocks both streams (XLA:CPU and non-async GPU collectives);
  * async start: issues on the comm stream when its inputs exist; compute continues; the matching
    ``wait`` node stalls compute until the transfer is done (that stall is the *exposed* communication);
  * loop: blocks both streams for trip_count x the makespan of its body region (bodies are
    scheduled once and cached); a conditional: its branches weighted by their expected executions
    (perfmodel/branches.py), or its costliest branch when unresolved.
Compute that runs while a transfer is in flight is slowed by ``hw.overlap_slowdown`` (Echo's
interference term). The result carries per-kind busy times, exposed communication and which
backend priced how many nodes, so every prediction can be audited.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

from perfmodel.costs import Chain
from perfmodel.graph import ExecGraph


@dataclasses.dataclass
class Timeline:
  makespan: float
  busy_by_kind: dict  # kind -> seconds (with loop multiplicity)
  exposed_comm: float  # seconds the compute stream waited on communication
  backend_counts: dict  # backend name -> number of priced node executions
  top_nodes: list  # [(seconds_total, name, kind, backend, op_name)] largest first
  by_layer: dict  # attribution.layer or '' -> seconds
  by_phase: dict  # fwd / bwd / opt -> seconds


def schedule(graph: ExecGraph, chain: Chain, region: str = None, _cache=None) -> Timeline:
  cache = {} if _cache is None else _cache
  name = region or graph.entry
  if name in cache:
    return cache[name]
  hw = chain.hw
  t_comp, t_comm = 0.0, 0.0
  end = {}
  busy, backends, layers, phases = defaultdict(float), defaultdict(int), defaultdict(float), defaultdict(float)
  per_node = []
  exposed = 0.0
  for n in graph.regions[name].nodes:
    ready = max((end[d] for d in n.deps if d in end), default=0.0)
    if n.kind == "loop":
      dur = 0.0
      start = max(t_comp, t_comm, ready)
      for sub, times in _bodies(graph, chain, n, cache):
        dur += sub.makespan * times
        for k, v in sub.busy_by_kind.items():
          busy[k] += v * times
        for k, v in sub.backend_counts.items():
          backends[k] += v * times
        for k, v in sub.by_layer.items():
          layers[k] += v * times
        for k, v in sub.by_phase.items():
          phases[k] += v * times
        exposed += sub.exposed_comm * times
        per_node += [(s * times, nm, kd, b, op) for s, nm, kd, b, op in sub.top_nodes]
      t_comp = t_comm = end[n.id] = start + dur
      continue
    if n.kind == "wait":
      s_end = end.get(n.start, ready)
      start = max(t_comp, ready)
      if s_end > start:
        exposed += s_end - start
      t_comp = end[n.id] = max(start, s_end)
      continue
    p = chain.price(n)
    dur = p.seconds
    backends[p.backend] += 1
    if n.collective is not None:
      busy[n.kind] += dur
      if n.collective.is_async:
        start = max(t_comm, ready, t_comp)
        t_comm = end[n.id] = start + dur
      else:
        start = max(t_comp, t_comm, ready)
        exposed += dur
        t_comp = t_comm = end[n.id] = start + dur
    else:
      start = max(t_comp, ready)
      if t_comm > start and hw.overlap_slowdown:
        dur *= 1 + hw.overlap_slowdown
      t_comp = end[n.id] = start + dur
      busy[n.kind] += dur
    layers[n.attribution.layer] += dur
    phases[n.attribution.phase] += dur
    per_node.append((dur, n.name, n.kind, p.backend, n.attribution.op_name))
  per_node.sort(reverse=True)
  tl = Timeline(makespan=max(t_comp, t_comm), busy_by_kind=dict(busy), exposed_comm=exposed,
                backend_counts=dict(backends), top_nodes=per_node[:20], by_layer=dict(layers), by_phase=dict(phases))
  cache[name] = tl
  return tl


def _bodies(graph: ExecGraph, chain: Chain, n, cache) -> list:
  """[(timeline, executions)] of a loop node's body: a while/call body x trip count; a conditional's branches
  x their resolved weights (perfmodel/branches.py), or its costliest branch once when unresolved."""
  if not n.branches:
    return [(schedule(graph, chain, n.body, cache), n.trip_count)]
  subs = [schedule(graph, chain, b, cache) for b in n.branches]
  if n.branch_weights:
    return [(sub, n.trip_count * w) for sub, w in zip(subs, n.branch_weights) if w]
  return [(max(subs, key=lambda t: t.makespan), n.trip_count)]
