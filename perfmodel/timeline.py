"""The timeline: where each priced node's time falls, on a compute stream and a communication stream.

:class:`Scheduler` is the one placement engine, used by prediction (:func:`schedule`, below) and by emulation
(perfmodel/emulate/timeline.py, which walks the branches a rank really took). Nodes arrive in issue order (a
compiled module is scheduled, so text order is issue order):

  * compute (dot, fusion, other): starts when the compute stream is free and its inputs exist;
  * synchronous collective: blocks both streams (XLA:CPU and non-async GPU collectives);
  * async start: issues on the comm stream when its inputs exist; compute continues; the matching ``wait`` stalls
    compute until the transfer is done (that stall is the *exposed* communication);
  * a block (a loop, a wait for peers): both streams, for a given time.
Compute that runs while a transfer is in flight is slowed by ``overlap_slowdown`` (Echo's interference term). With
``record`` the scheduler keeps the placed events (Perfetto traces, class alignment); consecutive compute nodes with
the same ``segment`` merge into one event.

:func:`schedule` walks one region of an execution graph with it: a loop blocks both streams for trip_count x the
makespan of its body (bodies are scheduled once and cached), a conditional for its branches weighted by their
expected executions (perfmodel/pipeline.py) or its costliest branch when unresolved. The result carries per-kind busy
times, exposed communication and which backend priced how many nodes, so every prediction can be audited.
:func:`align` and :func:`insert_waits` move recorded events: ranks meeting at synchronising collectives, a rank
waiting for its peers.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Optional

from perfmodel.cost.chain import Chain
from perfmodel.graph.nodes import ExecGraph


@dataclasses.dataclass
class Event:
  name: str
  cat: str  # compute | comm | wait
  start: float
  dur: float
  args: dict = dataclasses.field(default_factory=dict)


class Scheduler:
  def __init__(self, overlap_slowdown: float = 0.0, record: bool = False):
    self.overlap_slowdown = overlap_slowdown
    self.t_comp = self.t_comm = 0.0
    self.exposed = 0.0  # seconds the compute stream waited on communication
    self.end = {}  # node key -> end time
    self.events: Optional[list] = [] if record else None
    self._segment = None

  @property
  def makespan(self) -> float:
    return max(self.t_comp, self.t_comm)

  def ready(self, deps) -> float:
    """When the inputs of a node reading ``deps`` (keys of placed nodes) exist."""
    return max((self.end[d] for d in deps if d in self.end), default=0.0)

  def compute(self, dur: float, ready: float = 0.0, key=None, name: str = "", segment=None,
              args: Optional[dict] = None) -> float:
    """Places a compute node; returns its duration (slowed when a transfer is in flight)."""
    start = max(self.t_comp, ready)
    if self.t_comm > start and self.overlap_slowdown:
      dur *= 1 + self.overlap_slowdown
    self.t_comp = start + dur
    if key is not None:
      self.end[key] = self.t_comp
    if self.events is not None:
      last = self.events[-1] if self.events else None
      if segment is not None and last is not None and last.cat == "compute" and self._segment == segment:
        last.dur += dur
        last.args["nodes"] += 1
      else:
        self.events.append(Event(name, "compute", start, dur, {**(args or {}), "nodes": 1}
                                 if segment is not None else dict(args or {})))
      self._segment = segment
    return dur

  def collective(self, dur: float, ready: float = 0.0, is_async: bool = False, key=None, name: str = "",
                 args: Optional[dict] = None) -> float:
    """Places a collective; returns its start. Synchronous: both streams; async: the comm stream only."""
    if is_async:
      start = max(self.t_comm, ready, self.t_comp)
      self.t_comm = start + dur
      end = self.t_comm
    else:
      start = max(self.t_comp, self.t_comm, ready)
      self.exposed += dur
      self.t_comp = self.t_comm = end = start + dur
    if key is not None:
      self.end[key] = end
    self._record(Event(name, "comm", start, dur, dict(args or {})))
    return start

  def wait(self, start_key, ready: float = 0.0, key=None) -> None:
    """The compute stream waits for the async transfer started as ``start_key``."""
    s_end = self.end.get(start_key, ready)
    start = max(self.t_comp, ready)
    if s_end > start:
      self.exposed += s_end - start
    self.t_comp = max(start, s_end)
    if key is not None:
      self.end[key] = self.t_comp

  def block(self, dur: float, ready: float = 0.0, key=None, name: str = "", cat: str = "wait") -> float:
    """Both streams busy for ``dur`` (a loop's body, a wait for peers); returns the start."""
    start = max(self.t_comp, self.t_comm, ready)
    self.t_comp = self.t_comm = start + dur
    if key is not None:
      self.end[key] = self.t_comp
    if name:
      self._record(Event(name, cat, start, dur))
    return start

  def _record(self, e: Event) -> None:
    if self.events is not None:
      self.events.append(e)
      self._segment = None


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
  """The timeline of ``region`` (default: the entry) with every node priced by ``chain``."""
  cache = {} if _cache is None else _cache
  name = region or graph.entry
  if name in cache:
    return cache[name]
  sched = Scheduler(chain.hw.overlap_slowdown)
  busy, backends, layers, phases = defaultdict(float), defaultdict(int), defaultdict(float), defaultdict(float)
  per_node = []
  for n in graph.regions[name].nodes:
    ready = sched.ready(n.deps)
    if n.kind == "loop":
      dur = 0.0
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
        sched.exposed += sub.exposed_comm * times
        per_node += [(s * times, nm, kd, b, op) for s, nm, kd, b, op in sub.top_nodes]
      sched.block(dur, ready, key=n.id)
      continue
    if n.kind == "wait":
      # the wait is ready when its other inputs exist: the transfer's own end is what it waits for, and a stall
      # until then is exposed communication
      sched.wait(n.start, sched.ready(d for d in n.deps if d != n.start), key=n.id)
      continue
    p = chain.price(n)
    dur = p.seconds
    backends[p.backend] += 1
    if n.collective is not None:
      busy[n.kind] += dur
      sched.collective(dur, ready, n.collective.is_async, key=n.id)
    else:
      dur = sched.compute(dur, ready, key=n.id)
      busy[n.kind] += dur
    layers[n.attribution.layer] += dur
    phases[n.attribution.phase] += dur
    per_node.append((dur, n.name, n.kind, p.backend, n.attribution.op_name))
  per_node.sort(reverse=True)
  tl = Timeline(makespan=sched.makespan, busy_by_kind=dict(busy), exposed_comm=sched.exposed,
                backend_counts=dict(backends), top_nodes=per_node[:20], by_layer=dict(layers), by_phase=dict(phases))
  cache[name] = tl
  return tl


def _bodies(graph: ExecGraph, chain: Chain, n, cache) -> list:
  """[(timeline, executions)] of a loop node's body: a while/call body x trip count; a conditional's branches
  x their resolved weights (perfmodel/pipeline.py), or its costliest branch once when unresolved."""
  if not n.branches:
    return [(schedule(graph, chain, n.body, cache), n.trip_count)]
  subs = [schedule(graph, chain, b, cache) for b in n.branches]
  if n.branch_weights:
    return [(sub, n.trip_count * w) for sub, w in zip(subs, n.branch_weights) if w]
  return [(max(subs, key=lambda t: t.makespan), n.trip_count)]


def insert_waits(events: list, waits: list) -> list:
  """``events`` with wait events inserted: ``waits`` = [(index, seconds, name, args)], each placed where
  ``events[index]`` starts (``index == len(events)``: at the end) and everything from there on shifted by it."""
  by_index = defaultdict(list)
  for i, secs, name, args in waits:
    by_index[i].append((secs, name, args))
  out, shift = [], 0.0
  for i, e in enumerate(events):
    for secs, name, args in by_index.get(i, ()):
      out.append(Event(name, "wait", e.start + shift, secs, dict(args or {})))
      shift += secs
    out.append(dataclasses.replace(e, start=e.start + shift))
  end = max((e.start + e.dur for e in events), default=0.0)
  for secs, name, args in by_index.get(len(events), ()):
    out.append(Event(name, "wait", end + shift, secs, dict(args or {})))
    shift += secs
  return out


def align(events: dict, sync: dict, name: str = "wait (peer stages)") -> dict:
  """Ranks meeting at synchronising events: ``events`` maps a label to its recorded events, ``sync`` the label to
  the events of its list that synchronise (the same number for every label). The k-th synchronising event starts on
  every label when the last of them reaches it; a label that arrives earlier gets a wait event and everything after
  it shifts. Returns {label: events}."""
  labels = list(events)
  n_sync = len(sync[labels[0]])
  out = {k: [] for k in labels}
  shift = {k: 0.0 for k in labels}
  cursor = {k: 0 for k in labels}
  for j in range(n_sync + 1):
    arrive = {}
    for k in labels:  # every label up to its j-th synchronising event
      while cursor[k] < len(events[k]):
        e = events[k][cursor[k]]
        if j < n_sync and e is sync[k][j]:
          break
        out[k].append(dataclasses.replace(e, start=e.start + shift[k]))
        cursor[k] += 1
      if j < n_sync:
        arrive[k] = sync[k][j].start + shift[k]
    if j == n_sync:
      break
    go = max(arrive.values())
    for k in labels:
      if go > arrive[k]:
        out[k].append(Event(name, "wait", arrive[k], go - arrive[k]))
      shift[k] += go - arrive[k]
  return out
