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
import functools
import math
from collections import defaultdict
from typing import Optional

import numpy as np

from perfmodel.cost.chain import Chain
from perfmodel.graph.nodes import ExecGraph, parse_groups


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
    self.t_dp = 0.0  # the data-parallel network's stream (Overlap: gradient and parameter buckets)
    self.t_ring = {}  # a windowed einsum's ring transfers, one stream per direction (their own links)
    self.exposed = 0.0  # seconds the compute stream waited on communication
    self.end = {}  # node key -> end time
    self.start = {}  # compute node key -> start time
    self.events: Optional[list] = [] if record else None
    self._segment = None

  @property
  def makespan(self) -> float:
    return max(self.t_comp, self.t_comm, *self.t_ring.values())

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
      self.end[key], self.start[key] = self.t_comp, start
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
                 args: Optional[dict] = None, issued: Optional[float] = None, ring: int = 0) -> float:
    """Places a collective; returns its start. Synchronous: both streams; async: the comm stream only, from when
    compute issues it (``issued``: an earlier issue time, a transfer pipelined with the compute before it);
    ``ring``: a windowed einsum's transfer, on the stream of its direction."""
    if ring:
      start = max(self.t_ring.get(ring, 0.0), ready, self.t_comp)
      self.t_ring[ring] = end = start + dur
    elif is_async:
      start = max(self.t_comm, ready, self.t_comp if issued is None else issued)
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

  def dp_transfer(self, dur: float, start: float, key=None) -> float:
    """A transfer on the data-parallel stream from ``start`` (or when the stream frees); returns its end."""
    self.t_dp = max(self.t_dp, start) + dur
    if key is not None:
      self.end[key] = self.t_dp
    return self.t_dp

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
    """Both streams busy for ``dur`` (a loop's body, a wait for peers); returns the start. A transfer still in
    flight holds it back: that stall is exposed communication."""
    start = max(self.t_comp, self.t_comm, ready)
    self.exposed += max(0.0, self.t_comm - max(self.t_comp, ready))
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


@dataclasses.dataclass(frozen=True)
class Overlap:
  """Megatron-Core's overlap options on a compiled program (perfmodel/predict.py OVERLAP; perfmodel/README.md):

  * ``tp_comm``: a tensor-parallel collective inside a layer starts with the matmul that produces its input
    (chunks of the matmul and of the transfer pipelined), so only what it lasts beyond that matmul is exposed;
  * ``grad_reduce``: the data-parallel gradient reductions after the last backward loop run on the data-parallel
    network's own stream while the last micro-batch's backward computes (``bwd_window_s``), bucket by bucket: the
    last bucket (``bucket_fraction`` of the bytes) starts only when the backward ends;
  * ``param_gather``: the data-parallel all-gathers of the updated parameters run during the next step's first
    micro-batch forward (``fwd_window_s``); the first bucket is needed before it starts.
  ``sizes``: the mesh axes in order (partition id = row-major index over them), to tell a collective's axes."""
  tp_comm: bool = False
  grad_reduce: bool = False
  param_gather: bool = False
  sizes: tuple = ()  # ((axis, size), ...) in mesh order
  bwd_window_s: float = 0.0
  fwd_window_s: float = 0.0
  bucket_fraction: float = 0.0

  def axes(self, info) -> frozenset:
    """The mesh axes a collective's first group spans."""
    return _group_axes(info.kind, info.groups_text, info.n_devices, self.sizes)

  def role(self, n, entry: bool, after_loops: bool) -> Optional[str]:
    c = n.collective
    if c is None or c.kind == "collective-permute" or not self.sizes:
      return None
    axes = self.axes(c)
    if self.tp_comm and not entry and axes and axes <= {"tensor", "sequence"}:
      return "tp"
    if entry and after_loops and axes and axes <= {"data", "fsdp"}:
      if self.grad_reduce and c.kind in ("all-reduce", "reduce-scatter"):
        return "grad"
      if self.param_gather and c.kind == "all-gather":
        return "param"
    return None


@functools.lru_cache(maxsize=4096)
def _group_axes(kind: str, groups_text: str, n_devices: int, sizes: tuple) -> frozenset:
  groups = parse_groups(kind, groups_text, n_devices)
  if not groups or len(groups[0]) < 2 or math.prod(s for _, s in sizes) != n_devices:
    return frozenset()
  coords = np.array(np.unravel_index(np.asarray(groups[0]), tuple(s for _, s in sizes)))
  return frozenset(a for (a, _), row in zip(sizes, coords) if len(set(row.tolist())) > 1)


@dataclasses.dataclass
class Timeline:
  makespan: float
  busy_by_kind: dict  # kind -> seconds (with loop multiplicity)
  exposed_comm: float  # seconds the compute stream waited on communication
  backend_counts: dict  # backend name -> number of priced node executions
  top_nodes: list  # [(seconds_total, name, kind, backend, op_name)] largest first
  by_layer: dict  # attribution.layer or '' -> seconds
  by_phase: dict  # fwd / bwd / opt -> seconds
  events: Optional[list] = None  # the placed events, when recorded


def schedule(graph: ExecGraph, chain: Chain, region: str = None, _cache=None,
             overlap: Optional[Overlap] = None, record: bool = False) -> Timeline:
  """The timeline of ``region`` (default: the entry) with every node priced by ``chain``; ``overlap``: a
  framework's overlap options (:class:`Overlap`); ``record``: keep the region's placed events (a loop is one
  event)."""
  cache = {} if _cache is None else _cache
  name = region or graph.entry
  if name in cache:
    return cache[name]
  sched = Scheduler(chain.hw.overlap_slowdown, record=record)
  busy, backends, layers, phases = defaultdict(float), defaultdict(int), defaultdict(float), defaultdict(float)
  per_node = []
  nodes = graph.regions[name].nodes
  entry = name == graph.entry
  last_loop = max((i for i, n in enumerate(nodes) if n.kind == "loop"), default=-1)
  moved = {}  # collectives the overlap options moved to the data-parallel stream: key -> role
  param_start, param_dur = {}, {}
  for i, n in enumerate(nodes):
    for d in n.deps:  # a node reading a moved transfer waits for it
      if moved.get(d) == "grad":
        sched.wait(d)
    ready = sched.ready(n.deps)
    if n.kind == "loop":
      dur = 0.0
      for sub, times in _bodies(graph, chain, n, cache, overlap):
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
      sched.block(dur, ready, key=n.id, name=n.name if record else "", cat="compute")
      continue
    if n.kind == "wait" and moved.get(n.start) == "param":
      continue  # read by the next step (below)
    if n.kind == "wait":
      # the wait is ready when its other inputs exist: the transfer's own end is what it waits for, and a stall
      # until then is exposed communication
      sched.wait(n.start, sched.ready(d for d in n.deps if d != n.start), key=n.id)
      continue
    p = chain.price(n)
    dur = p.seconds
    backends[p.backend] += 1
    role = overlap.role(n, entry, i > last_loop) if overlap is not None else None
    if role == "tp":
      producer = max((d for d in n.deps if d in sched.start), key=lambda d: sched.end[d], default=None)
      busy[n.kind] += dur
      issued = sched.start.get(producer, ready)  # chunk by chunk as the matmul produces them
      sched.collective(dur, issued, True, key=n.id, issued=issued, name=n.name)
      if not n.collective.is_async:  # synchronous in the program: what follows reads it
        sched.wait(n.id)
    elif role in ("grad", "param"):
      busy[n.kind] += dur
      moved[n.id] = role
      if role == "grad":  # the last bucket is reduced only once the backward has produced it
        end = sched.dp_transfer(dur, ready - overlap.bwd_window_s)
        sched.end[n.id] = max(end, ready + overlap.bucket_fraction * dur)
      else:
        param_dur[n.id] = dur
        param_start[n.id] = sched.dp_transfer(dur, ready, key=n.id) - dur
    elif n.collective is not None:
      busy[n.kind] += dur
      sched.collective(dur, ready, n.collective.is_async, key=n.id, name=n.name, ring=n.collective.ring)
    else:
      dur = sched.compute(dur, ready, key=n.id, name=n.name)
      busy[n.kind] += dur
    layers[n.attribution.layer] += dur
    phases[n.attribution.phase] += dur
    per_node.append((dur, n.name, n.kind, p.backend, n.attribution.op_name))
  makespan = sched.makespan
  grads = [sched.end[k] for k, r in moved.items() if r == "grad"]
  if grads:  # reductions nothing in the region read: the step ends with them
    sched.exposed += max(0.0, max(grads) - makespan)
    makespan = max(makespan, max(grads))
  params = [k for k, r in moved.items() if r == "param"]
  if params:
    # steady state: the next step's first micro-batch forward reads them, its first bucket before it starts
    start, end = min(param_start[k] for k in params), max(sched.end[k] for k in params)
    total = sum(param_dur[k] for k in params)
    tail = max(0.0, start + overlap.bucket_fraction * total - makespan, end - overlap.fwd_window_s - makespan)
    sched.exposed += tail
    makespan += tail
  per_node.sort(reverse=True)
  tl = Timeline(makespan=makespan, busy_by_kind=dict(busy), exposed_comm=sched.exposed,
                backend_counts=dict(backends), top_nodes=per_node[:20], by_layer=dict(layers), by_phase=dict(phases),
                events=sched.events)
  if not record:
    cache[name] = tl
  return tl


def _bodies(graph: ExecGraph, chain: Chain, n, cache, overlap=None) -> list:
  """[(timeline, executions)] of a loop node's body: a while/call body x trip count; a conditional's branches
  x their resolved weights (perfmodel/pipeline.py), or its costliest branch once when unresolved."""
  if not n.branches:
    return [(schedule(graph, chain, n.body, cache, overlap), n.trip_count)]
  subs = [schedule(graph, chain, b, cache, overlap) for b in n.branches]
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
