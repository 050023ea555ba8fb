"""Pipeline schedules in time: one model, the schedule table of the step the framework runs.

A pipelined step (parallelism/pipeline.py) runs in lock-step ticks; its schedule table (parallelism/schedules.py)
says, per tick, which stage has forward and which has backward work (``fwd_TxP``, ``bwd_TxP``), each slot one
chunk of ``L/(vP)`` layers (``v`` = ``mesh.virtual_stages``). Each tick ends with a point-to-point send every stage
waits for, so a tick lasts as long as its busiest stage, and a step is the sum over ticks of that maximum
(:func:`tick_time`). For stages of equal cost this is (vm + p - 1)(f + b)/v, bubble fraction (p - 1)/(vm + p - 1):
the textbook GPipe / 1F1B for v = 1, interleaved 1F1B and the circular pipeline for v > 1.

* The analytic route (:func:`cost`) prices one micro-batch's forward f and backward b on a stage and adds the
  point-to-point transfers on the critical path, 2(vp - 1) x c.
* A compiled pipelined program decides at run time which slots run: it skips idle work with ``lax.cond`` under named
  scopes (``pp_fwd_slot``, ``pp_bwd_slot``, ``pp_first_stage``, ``pp_last_stage``) that its conditionals keep in
  their op_name. The table says on how many of the T ticks stage s works, so :func:`resolve` sets each branch's
  expected executions per visit exactly: forward slot [1 - vM/T, vM/T] (false, true), first / last virtual stage
the share of the stage's units that are on it. ``stage=None`` averages over
  stages (what N virtual CPU devices on shared cores add up to); ``stage=s`` is that stage's program, and
  :func:`lockstep_extra` adds the ticks it idles waiting for the busiest stage. Any other conditional is priced by
  its costliest branch (an upper bound; counted).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from parallelism import pipeline as pp
from perfmodel import timeline
from perfmodel.graph.nodes import ExecGraph


@dataclasses.dataclass(frozen=True)
class PipelineCost:
  step_time: float
  bubble_fraction: float  # share of the ticks' time the stages idle (transfers left out)
  ideal_time: float  # m (f + b): the work with no bubble


def tick_time(sched, fwd_s: list, bwd_s: list) -> float:
  """Seconds of a lock-step schedule: the sum over ticks of the busiest stage's slot work (per-stage forward and
  backward slot times ``fwd_s[s]``, ``bwd_s[s]``: one chunk's)."""
  f, b = np.asarray(fwd_s, dtype=float), np.asarray(bwd_s, dtype=float)
  return float(((sched.fwd_TxP >= 0) * f[None, :] + (sched.bwd_TxP >= 0) * b[None, :]).max(axis=1).sum())


def cost(schedule: str, p: int, m: int, f: float, b: float, c: float = 0.0, v: int = 1) -> PipelineCost:
  """A step of ``m`` micro-batches over ``p`` equal stages (forward ``f``, backward ``b`` per micro-batch and
  stage, ``c`` per point-to-point transfer) under ``schedule`` (the framework's: gpipe or 1f1b) with ``v`` virtual
  stages per device."""
  if p <= 1:
    return PipelineCost(m * (f + b), 0.0, m * (f + b))
  ticks = tick_time(pp.make_schedule(schedule, p, m, v), [f / v] * p, [b / v] * p)
  return PipelineCost(ticks + 2 * (v * p - 1) * c, 1 - m * (f + b) / ticks if ticks else 0.0, m * (f + b))


# ---------------------------------------------------------------- the compiled program's slots

def role(op_name: str) -> Optional[str]:
  """The innermost pipeline scope in an op_name (the predicate of that conditional), or None."""
  best, pos = None, -1
  for sc in (pp.SCOPE_FWD, pp.SCOPE_BWD, pp.SCOPE_FIRST, pp.SCOPE_LAST):
    i = op_name.rfind(sc + "/")
    if i > pos:
      best, pos = sc, i
  return best


def true_fraction(r: str, sched, stage: Optional[int]) -> float:
  """Share of visits on which a conditional of pipeline role ``r`` takes its true branch."""
  p = sched.n_stages
  stages = range(p) if stage is None else [stage]
  if r == pp.SCOPE_FWD:
    return float(np.mean([(sched.fwd_TxP[:, s] >= 0).mean() for s in stages]))
  if r == pp.SCOPE_BWD:
    return float(np.mean([(sched.bwd_TxP[:, s] >= 0).mean() for s in stages]))
  # First / last virtual stage: visited in both slots of a busy tick; the share of the stage's units on it.
  if r == pp.SCOPE_FIRST:
    return float(np.mean([_share_on(sched, s, 0) for s in stages]))
  if r == pp.SCOPE_LAST:
    return float(np.mean([_share_on(sched, s, sched.n_chunks * p - 1) for s in stages]))
  raise ValueError(r)


def _share_on(sched, stage: int, virtual_stage: int) -> float:
  busy = sched.fwd_TxP[:, stage] >= 0
  return float((sched.virtual_stage(sched.fwd_chunk_TxP)[busy, stage] == virtual_stage).mean())


def schedule_of(cfg):
  """The pipeline schedule a config's step runs (parallelism/pipeline.py), or None when not pipelined."""
  if cfg.mesh.pipeline <= 1:
    return None
  return pp.schedule_of(cfg)


def _conditionals(g: ExecGraph):
  for reg in g.regions.values():
    for i, n in enumerate(reg.nodes):
      if n.branches:
        yield reg, i, n


def resolve(g: ExecGraph, chain, sched=None, stage: Optional[int] = None) -> dict:
  """Sets ``branch_weights`` on every conditional of ``g`` (in place); returns how each was resolved."""
  counts = {"pipeline_schedule": 0, "costliest_branch": 0}
  for reg, i, n in list(_conditionals(g)):
    r = role(n.attribution.op_name) if sched is not None else None
    if r is not None and len(n.branches) == 2:
      f = true_fraction(r, sched, stage)
      reg.nodes[i] = dataclasses.replace(n, branch_weights=(1.0 - f, f))
      counts["pipeline_schedule"] += 1
  # The rest: costliest branch, priced with the schedule-resolved ones already in place.
  for reg, i, n in list(_conditionals(g)):
    if n.branch_weights:
      continue
    cache = {}
    spans = [timeline.schedule(g, chain, b, cache).makespan for b in n.branches]
    best = int(np.argmax(spans))
    reg.nodes[i] = dataclasses.replace(n, branch_weights=tuple(float(j == best) for j in range(len(spans))))
    counts["costliest_branch"] += 1
  return counts


def slot_work(g: ExecGraph, chain) -> tuple:
  """(forward, backward) seconds of one busy slot (one chunk): the true branch of the pp_fwd_slot / pp_bwd_slot
  conditionals (0 when the program has none)."""
  out = {pp.SCOPE_FWD: 0.0, pp.SCOPE_BWD: 0.0}
  cache = {}
  for _, _, n in _conditionals(g):
    r = role(n.attribution.op_name)
    if r in out and len(n.branches) == 2:
      out[r] = max(out[r], timeline.schedule(g, chain, n.branches[1], cache).makespan)
  return out[pp.SCOPE_FWD], out[pp.SCOPE_BWD]


def lockstep_extra(sched, fwd_s: list, bwd_s: list, stage: int) -> float:
  """Seconds stage ``stage`` idles in lock-step ticks: :func:`tick_time` minus its own slot work."""
  f, b = np.asarray(fwd_s), np.asarray(bwd_s)
  own = float(((sched.fwd_TxP[:, stage] >= 0) * f[stage] + (sched.bwd_TxP[:, stage] >= 0) * b[stage]).sum())
  return tick_time(sched, fwd_s, bwd_s) - own
