"""Hybrid execution, the composed half: one rank's timeline at the target scale.

Inputs: the compiled stand-in program of the rank (its HLO, parsed into the execution graph
``perfmodel predict`` prices, perfmodel/graph/), the measured step time of that program on the local device,
and the collective records. This module walks the graph in program order, each ``conditional`` into the
branch the rank really took (the compiled module is scheduled, so text order is execution order; loops are
expanded trip by trip), and decides what each node costs; where its time falls is placed by the core's
scheduler (perfmodel/timeline.py), the one prediction uses:

* compute nodes get **measured** time: the measured total is spread over the nodes in proportion to
  their modelled cost (the roofline of the local device), so the sum is exactly the measurement and only
  the split inside it is modelled;
* the nodes of a stand-in (marked ``emu_c<i>`` in their op_name) are removed, together with their
  share of the measured time, and replaced by the real collective, priced by perfmodel/cost/collectives.py
  on the *target* hardware profile for the rank's real group of global ids;
* collectives are synchronous: the stand-in program is compiled for the local device, which has no
  async collectives to overlap (XLA:CPU, the validation target, runs them synchronously too); see
  perfmodel/emulate/README.md for GPU overlap.

Ranks whose programs differ (pipeline stages) are composed by :func:`compose`: a collective over an
axis that separates classes is a synchronisation point where every class waits for the slowest
(this is what makes pipeline bubbles appear). Collectives inside one class meet peers that run the same
program: no structural wait, only the noise of who arrives last, added per call by :func:`add_call_waits`
where it was measured (replayed calls), else once per step by :func:`add_straggler_wait`.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Optional

from perfmodel import timeline as core
from perfmodel.cost import chain as chain_lib
from perfmodel.cost import collectives as coll_model
from perfmodel.emulate.standins import branch_marker, marker_index
from perfmodel.emulate.topology import RankSpace
from perfmodel.graph import hlo_parse as hp
from perfmodel.graph.from_hlo import build_graph as _build
from perfmodel.hardware import HardwareProfile

Event = core.Event

MAX_EVENTS = 2_000_000  # flattened nodes walked per rank; past it the rest of a loop is priced as a block (no comm events)


@dataclasses.dataclass
class RankTimeline:
  rank: int
  events: list  # Event in time order (start relative to the step start)
  compute_s: float  # measured compute, stand-ins removed
  standin_local_s: float  # measured time attributed to stand-in nodes (removed)
  comm_s: float  # modelled collective time on this rank
  wait_s: float = 0.0  # time waiting for other classes (pipeline bubbles), filled by compose()
  unplaced: int = 0  # collective records with no node in the compiled program (appended at the end)
  by_kind: dict = dataclasses.field(default_factory=dict)
  collective_calls: int = 0  # collective calls per step after combining
  branches: dict = dataclasses.field(default_factory=dict)  # cond site -> {branch: executions walked}
  untraced_branches: int = 0  # conditional executions priced by their costliest branch (no trace)
  compute_source: str = "measured"

  @property
  def iteration_s(self) -> float:
    return max((e.start + e.dur for e in self.events), default=0.0)


def median_max(samples, k: int) -> float:
  """The median over steps of the max of k independent draws from the empirical distribution of ``samples``:
  the max of k draws is below x with probability F(x)^k, so its median is the quantile 0.5^(1/k) of the
  samples (linear interpolation between order statistics). k = 1 gives the median itself.

  Why the median and not E[max]: step times are reported as medians over steps (the real job's and the
  emulated rank's alike), so the slowest-rank term must be the same statistic. The mean lets a single stalled
  step among ten (0.92 s against 0.36-0.42 s) add 0.11 s to a 0.47 s step, and it gives a one-rank job a
  wait of mean - median."""
  xs = sorted(samples)
  pos = 0.5 ** (1.0 / k) * (len(xs) - 1)
  lo = int(pos)
  hi = min(len(xs) - 1, lo + 1)
  return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def add_straggler_wait(tl: RankTimeline, seconds: float) -> RankTimeline:
  """The rank waits ``seconds`` for its slowest peer before the step's last collective (the gradient
  reduction every layout ends with); that collective and everything after it shift by ``seconds``."""
  if seconds <= 0 or not tl.events:
    return tl
  comm = [i for i, e in enumerate(tl.events) if e.cat == "comm"]
  at = comm[-1] if comm else len(tl.events)
  events = core.insert_waits(tl.events, [(at, seconds, "wait (straggling peers)", None)])
  return dataclasses.replace(tl, events=events, wait_s=tl.wait_s + seconds)


def add_call_waits(tl: RankTimeline, waits: dict, structural: tuple) -> tuple:
  """Adds, before each collective call that ``waits`` prices (``collectives.call_key`` -> seconds), the rank's
  expected wait for its peer at that call; returns (timeline, seconds added). Only calls among *symmetric*
  peers get one: ranks of the rank's own class (no ``structural`` axis in the call), which arrive after the
  same program's compute, so either may be the later one and the earlier waits. Calls over a structural
  axis (pipeline stages) are aligned by :func:`compose` from the stages' own timelines instead.

  Why per call: a step with K synchronising calls lasts the sum over its K segments of the later rank's
  arrival, not the later rank's whole step; with independent noise per segment the sum of the K per-segment
  maxima exceeds the max of the sums (the straggler term) and grows with K."""
  if not waits or not tl.events:
    return tl, 0.0
  inserts = []
  for i, e in enumerate(tl.events):
    w = 0.0
    if (e.cat == "comm" and "sizes" in e.args and not set(e.args.get("axes", ())) & set(structural)):
      w = waits.get(coll_model.call_key(e.args["kind"], e.args["sizes"]), 0.0)
    if w > 0:
      inserts.append((i, w, "wait (peer, this call)", {"call": e.name}))
  added = 0.0
  for _, w, _, _ in inserts:
    added += w
  return dataclasses.replace(tl, events=core.insert_waits(tl.events, inserts), wait_s=tl.wait_s + added), added


def build_graph(module):
  """The execution graph of the module (it has a region for every branch of every ``conditional``; emulation
  walks the branch that really ran)."""
  return _build(module, 1, program_bytes=False)


class _Walker:
  """Flattens the graph into (node, instance path) in execution order: loops expanded trip by trip,
  each ``conditional`` into the branch that ran (from the branch trace), else its costliest branch."""

  def __init__(self, graph, module, trace: Optional[dict], price):
    self.graph, self.module, self.price = graph, module, price
    self.trace = {k: list(v) for k, v in (trace or {}).items()}
    self.cursor = defaultdict(int)
    self.marker = branch_marker
    self.taken = defaultdict(lambda: defaultdict(int))  # cond site -> branch -> executions walked
    self.unknown = 0  # conditional executions with no trace entry (priced by their costliest branch)
    self._cost = {}

  def region_cost(self, region: str) -> float:
    if region not in self._cost:
      self._cost[region] = 0.0
      tot = 0.0
      for n in self.graph.regions[region].nodes:
        if n.kind == "loop" and n.opcode != "conditional":
          tot += self.region_cost(n.body) * n.trip_count
        elif n.opcode == "conditional":
          tot += max((self.region_cost(c) for c in n.branches), default=0.0)
        else:
          tot += self.price(n)
      self._cost[region] = tot
    return self._cost[region]

  def walk(self, region: str, path: tuple, out: list, budget: list):
    for n in self.graph.regions[region].nodes:
      if n.opcode == "conditional":
        comps = n.branches
        site = self.marker(n.attribution.op_name)
        seq = self.trace.get(site) if site is not None else None
        if seq is not None and self.cursor[site] < len(seq) and seq[self.cursor[site]] < len(comps):
          k = seq[self.cursor[site]]
          self.cursor[site] += 1
        else:
          self.unknown += 1
          k = max(range(len(comps)), key=lambda i: self.region_cost(comps[i])) if comps else 0
        if comps:
          self.taken[site][k] += 1
          self.walk(comps[k], path + ((n.name, k),), out, budget)
        continue
      if n.kind == "loop":
        for i in range(n.trip_count):
          if budget[0] <= 0:
            out.append((n, path + (("loop-rest", n.trip_count - i),)))
            break
          self.walk(n.body, path + ((n.name, i),), out, budget)
        continue
      budget[0] -= 1
      out.append((n, path))


def _marker_map(module) -> dict:
  """(computation, instruction name) -> (sorted stand-in indices inside it, pure): ``pure`` when every
  real instruction of the node (descending into fusions) belongs to a stand-in."""
  cache = {}

  def scan(comp_name):
    if comp_name in cache:
      return cache[comp_name]
    cache[comp_name] = (set(), True)
    comp = module.computations.get(comp_name)
    idx, pure = set(), True
    for ins in comp.instructions if comp else ():
      if ins.opcode in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "broadcast"):
        continue
      i = marker_index(ins.op_name)
      if ins.opcode == "fusion":
        sub_idx, sub_pure = scan(ins.called()[0])
        idx |= sub_idx
        pure &= sub_pure and bool(sub_idx)
      elif i is not None:
        idx.add(i)
      else:
        pure = False
    cache[comp_name] = (idx, pure)
    return cache[comp_name]

  out = {}
  for cname, comp in module.computations.items():
    for ins in comp.instructions:
      i = marker_index(ins.op_name)
      if ins.opcode == "fusion":
        idx, pure = scan(ins.called()[0])
        if i is not None:
          idx = idx | {i}
        if idx:
          out[(cname, ins.name)] = (tuple(sorted(idx)), pure)
      elif i is not None:
        out[(cname, ins.name)] = ((i,), True)
  return out


def collective_seconds(rec, space: RankSpace, rank: int, hw: HardwareProfile, algorithm: str = "auto",
                       sizes=None) -> tuple:
  """``sizes``: the operand payloads when ``rec`` stands for a combined call (priced by
  ``perfmodel.cost.collectives.combined_cost``)."""
  group = rec.group(space, rank)
  if len(group) <= 1 or rec.bytes <= 0:
    return 0.0, "none"
  c = coll_model.combined_cost(rec.kind, sizes or [rec.bytes], group, hw, algorithm)
  return c.seconds + hw.launch_overhead, c.algorithm


def _combine_groups(flat, markers, node_region, rec_by_index, combine: bool) -> dict:
  """(site, instance path) of each combined call's first member -> the member sites.

  Mirrors XLA's collective combiners on the real program: within one loop iteration / branch
  instance, collectives of one kind over the same axes (and permutation) merge into one call unless
  one depends on another's result (measured on the validation configs: the data-parallel step's 13
  gradient psums and the loss psum compile to a single all-reduce)."""
  out, open_, assigned = {}, {}, {}  # open_: (path, kind key) -> first member key; assigned: key -> head
  anc = {}  # (path, node id) -> frozenset of first-member keys it depends on (transitively)
  for n, path in flat:
    idxs, _ = markers.get((node_region.get(n.id), n.name), ((), False))
    deps = frozenset().union(*[anc.get((path, d), frozenset()) for d in n.deps]) if n.deps else frozenset()
    mine = set()
    for idx in idxs:
      rec = rec_by_index.get(idx)
      if rec is None:
        continue
      key = (idx, path)
      if key in assigned:  # another node of the same stand-in (its output read by several fusions)
        mine.add(assigned[key])
        continue
      kk = (path, rec.kind, rec.axes, rec.perm)
      head = open_.get(kk)
      if not combine or head is None or head in deps:
        out[key] = [idx]
        open_[kk] = head = key
      else:
        out[head].append(idx)
      assigned[key] = head
      mine.add(head)
    anc[(path, n.id)] = deps | frozenset(mine)
  return {k: v for k, v in out.items()}


def rank_timeline(rank: int, hlo_text: str, records: list, measured_s: float, space: RankSpace,
                  target_hw: HardwareProfile, local_hw: HardwareProfile, algorithm: str = "auto",
                  branch_trace: Optional[dict] = None, combine: bool = True,
                  compute_hw: Optional[HardwareProfile] = None, node_times: Optional[dict] = None) -> RankTimeline:
  """``measured_s``: the measured step of the stand-in program (spread over the executed nodes).
  ``compute_hw``: when nothing was measured (compile only), compute nodes are priced by the roofline
  of this profile instead (then the compute time is modelled, and the result says so).
  ``combine``: consecutive collectives of one kind over the same axes with no compute between them
  run as one (what XLA's collective combiners do to the real program: measured on the validation
  configs, the 13 gradient psums of the data-parallel step compile to 1 all-reduce).
  ``node_times``: in-program seconds per execution of each instruction, traced on the real rank
  (``measure.run_rank(trace_nodes=True)``): the measured total is then spread over the nodes by these
  instead of by roofline shares (nodes the trace missed keep their roofline cost, scaled like the traced
  ones), so the split inside the step (which pipeline tick, before or after which collective) is measured too."""
  module = hp.parse_module(hlo_text)
  graph = build_graph(module)
  node_region = {n.id: r for r, reg in graph.regions.items() for n in reg.nodes}
  markers = _marker_map(module)
  chain = chain_lib.make_chain(compute_hw or local_hw, "roofline")
  roof = lambda n: 0.0 if n.kind == "wait" else chain.price(n).seconds  # noqa: E731
  ratio = 1.0
  if node_times:
    nodes = [n for reg in graph.regions.values() for n in reg.nodes if n.kind in ("dot", "fusion", "other")]
    hit = [n for n in nodes if n.name in node_times]
    ratio = (sum(node_times[n.name] for n in hit) / max(sum(roof(n) for n in hit), 1e-30)) if hit else 1.0

  def price(n):
    if not node_times:
      return roof(n)
    if n.kind in ("dot", "fusion", "other"):
      t = node_times.get(n.name)
      return t if t is not None else roof(n) * ratio
    return roof(n) * ratio
  walker = _Walker(graph, module, branch_trace, price)
  flat = []
  walker.walk(graph.entry, (), flat, [MAX_EVENTS])
  model = []
  for n, path in flat:
    if n.kind == "loop":  # collapsed remainder of a huge loop
      model.append(walker.region_cost(n.body) * dict(path).get("loop-rest", 1))
      continue
    model.append(price(n))
  total_model = sum(model) or 1.0
  scale = measured_s / total_model if measured_s > 0 else (1.0 if compute_hw is not None else 0.0)
  rec_by_index = {r.index: r for r in records}
  groups = _combine_groups(flat, markers, node_region, rec_by_index, combine)
  sched = core.Scheduler(record=True)  # collectives are synchronous: both streams, in walk order
  seen = set()
  standin_local, compute, comm = 0.0, 0.0, 0.0
  by_kind = defaultdict(float)
  calls = 0
  last_comm_end = 0.0
  for (n, path), m in zip(flat, model):
    dur = m * scale
    idxs, pure = markers.get((node_region.get(n.id), n.name), ((), False))
    for idx in idxs:
      # The collective runs before the node holding its stand-in (the stand-in's output is its result);
      # a combined call runs where its first member would.
      key = (idx, path)
      if idx not in rec_by_index or key in seen:
        continue
      seen.add(key)
      members = groups.get(key)
      if members is None:
        continue  # a later member of a combined call: already placed
      recs = [rec_by_index[i] for i in members]
      head = recs[0]
      merged = dataclasses.replace(head, bytes=sum(r.bytes for r in recs))
      sizes = [b for r in recs for b in r.sizes()]
      secs, alg = collective_seconds(merged, space, rank, target_hw, algorithm, sizes=sizes)
      if secs <= 0:
        continue
      sched.collective(secs, name=f"{head.kind} {'x'.join(head.axes)}" + (
          f" ({len(recs)} combined)" if len(recs) > 1 else ""), args={
              "bytes": merged.bytes, "group_size": head.group_size, "axes": list(head.axes), "algorithm": alg,
              "sites": members, "scope": head.scope, "kind": head.kind, "sizes": sizes,
              "compute_before_s": sched.t_comp - last_comm_end})
      last_comm_end = sched.t_comp
      comm += secs
      calls += 1
      by_kind[head.kind] += secs
    if idxs and pure:
      standin_local += dur  # pure stand-in work: replaced by the collective above
      continue
    if dur <= 0:
      continue
    phase = n.attribution.phase
    sched.compute(dur, name=f"compute {phase}", segment=phase,
                  args={"phase": phase, "nodes": 0, "layer": n.attribution.layer})
    compute += dur
  in_program = {i for v, _ in markers.values() for i in v}
  unplaced = 0
  for rec in records:  # collectives XLA left without a node of their own (e.g. a fused stand-in)
    if rec.index in in_program:
      continue  # walked where it ran (or never ran: its branch was not taken)
    secs, alg = collective_seconds(rec, space, rank, target_hw, algorithm, sizes=rec.sizes())
    if secs <= 0:
      continue
    unplaced += 1
    total = secs * rec.trips
    sched.collective(total, name=f"{rec.kind} {'x'.join(rec.axes)} (unplaced x{rec.trips})",
                     args={"bytes": rec.bytes, "group_size": rec.group_size, "site": rec.index, "algorithm": alg})
    comm += total
    calls += rec.trips
    by_kind[rec.kind] += total
  return RankTimeline(rank=rank, events=sched.events, compute_s=compute, standin_local_s=standin_local, comm_s=comm,
                      unplaced=unplaced, by_kind=dict(by_kind), collective_calls=calls,
                      branches={str(k): dict(v) for k, v in walker.taken.items()},
                      untraced_branches=walker.unknown, compute_source="measured" if measured_s > 0 else
                      ("modelled (roofline of %s)" % (compute_hw.name if compute_hw else "?")))


def compose(timelines: dict, sync_axes: tuple) -> dict:
  """Aligns class representatives at collectives over ``sync_axes`` (axes separating classes): the
  k-th such collective starts on every class when the slowest class reaches it. ``timelines`` maps a
  class label to its RankTimeline; returns new timelines with 'wait' events for the bubbles."""
  if len(timelines) <= 1 or not sync_axes:
    return timelines
  def sync(tl, p2p_only):
    return [e for e in tl.events if e.cat == "comm" and set(e.args.get("axes", ())) & set(sync_axes)
            and (not p2p_only or e.name.startswith("collective-permute"))]
  seqs = {k: sync(tl, False) for k, tl in timelines.items()}
  if len({len(s) for s in seqs.values()}) != 1:
    # Stages issue different reductions over the structural axis (e.g. the first stage's embedding
    # gradient), but every stage sends/receives the same point-to-point transfers each tick: align on those.
    seqs = {k: sync(tl, True) for k, tl in timelines.items()}
  lengths = {len(s) for s in seqs.values()}
  if len(lengths) != 1:
    return timelines  # classes disagree on their synchronising collectives: left unaligned (reported)
  aligned = core.align({k: tl.events for k, tl in timelines.items()}, seqs)
  return {k: dataclasses.replace(tl, events=aligned[k], wait_s=sum(e.dur for e in aligned[k] if e.cat == "wait"))
          for k, tl in timelines.items()}
