"""Pipeline schedules in time: the analytic route's closed forms, and the compiled program's branch weights.

Closed forms (the analytic route; ``search``): p stages, m micro-batches, per-micro-batch forward time f and
backward time b per stage, v virtual chunks per device (interleaved), P2P time c per boundary crossing.

  GPipe       T = (m + p - 1)(f + b),           bubble fraction (p-1)/(m+p-1), m micro-batches in flight
  1F1B        T = (m + p - 1)(f + b),           same bubble, only p micro-batches of activations live
  interleaved T = (m + (p-1)/v)(f + b),         bubble (p-1)/(v m + p - 1)  (Megatron-LM, Narayanan 2021)
:func:`simulate` executes the per-stage operation lists with their dependencies; tests check it reproduces the
closed forms.

A compiled pipelined program (parallelism/pipeline.py) decides at run time which slots run: it skips idle work
with ``lax.cond`` under named scopes (``pp_fwd_slot``, ``pp_bwd_slot``, ``pp_first_stage``, ``pp_last_stage``) that
the compiled conditionals keep in their op_name. The schedule table says on how many of the T ticks stage s has
forward / backward work, and which stage is first / last, so :func:`resolve` sets each branch's expected executions
per visit exactly: forward slot [1 - M/T, M/T] (false, true). ``stage=None`` averages over stages (what N virtual
CPU devices on one core add up to); ``stage=s`` is that stage's program. Any other conditional is priced by its
costliest branch (an upper bound; counted). :func:`lockstep_extra` adds what a per-stage sum leaves out on parallel
hardware: ticks are lock-step (each ends with a point-to-point send every stage waits for), so a tick lasts as long
as its busiest stage.
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
  bubble_fraction: float
  ideal_time: float  # m (f + b): the work with no bubble
  in_flight: int  # micro-batches whose activations are alive at once on stage 0


def gpipe(p: int, m: int, f: float, b: float, c: float = 0.0) -> PipelineCost:
  t = (m + p - 1) * (f + b) + 2 * (p - 1) * c
  return PipelineCost(t, (p - 1) / (m + p - 1), m * (f + b), m)


def one_f_one_b(p: int, m: int, f: float, b: float, c: float = 0.0) -> PipelineCost:
  t = (m + p - 1) * (f + b) + 2 * (p - 1) * c
  return PipelineCost(t, (p - 1) / (m + p - 1), m * (f + b), min(p, m))


def interleaved(p: int, m: int, f: float, b: float, v: int, c: float = 0.0) -> PipelineCost:
  if m % p:
    raise ValueError(f"interleaved 1F1B needs micro-batches ({m}) divisible by stages ({p})")
  t = (m + (p - 1) / v) * (f + b) + 2 * (p - 1) * c * v
  return PipelineCost(t, (p - 1) / (v * m + p - 1), m * (f + b), min(p, m))


def cost(schedule: str, p: int, m: int, f: float, b: float, v: int = 1, c: float = 0.0) -> PipelineCost:
  if p <= 1:
    return PipelineCost(m * (f + b), 0.0, m * (f + b), m)
  if schedule == "gpipe":
    return gpipe(p, m, f, b, c)
  if schedule == "1f1b":
    return one_f_one_b(p, m, f, b, c)
  if schedule == "interleaved":
    return interleaved(p, m, f, b, v, c)
  raise ValueError(f"unknown pipeline schedule {schedule!r}: gpipe, 1f1b or interleaved")


def _ops(schedule: str, p: int, m: int, s: int) -> list:
  """Operation order of stage s: list of ('F'|'B', micro-batch)."""
  if schedule == "gpipe":
    return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
  if schedule == "1f1b":
    warm = min(p - s - 1, m)
    ops = [("F", i) for i in range(warm)]
    f_next, b_next = warm, 0
    while b_next < m:
      if f_next < m:
        ops.append(("F", f_next))
        f_next += 1
      ops.append(("B", b_next))
      b_next += 1
    return ops
  raise ValueError(f"simulate supports gpipe and 1f1b, got {schedule!r}")


def simulate(schedule: str, p: int, m: int, f: float, b: float, c: float = 0.0) -> dict:
  """Event simulation of a schedule; returns makespan, bubble fraction and max in-flight micro-batches."""
  ops = [_ops(schedule, p, m, s) for s in range(p)]
  done = {}  # (kind, stage, mb) -> end time
  t_stage = [0.0] * p
  pos = [0] * p
  in_flight, max_live = [0] * p, [0] * p
  progress = True
  while progress:
    progress = False
    for s in range(p):
      while pos[s] < len(ops[s]):
        kind, i = ops[s][pos[s]]
        if kind == "F":
          dep = done.get(("F", s - 1, i)) if s > 0 else 0.0
        else:
          dep = done.get(("B", s + 1, i)) if s < p - 1 else done.get(("F", s, i))
        if dep is None:
          break
        start = max(t_stage[s], dep + (c if (kind == "F" and s > 0) or (kind == "B" and s < p - 1) else 0.0))
        t_stage[s] = done[(kind, s, i)] = start + (f if kind == "F" else b)
        in_flight[s] += 1 if kind == "F" else -1
        max_live[s] = max(max_live[s], in_flight[s])
        pos[s] += 1
        progress = True
  if any(pos[s] < len(ops[s]) for s in range(p)):
    raise RuntimeError("pipeline schedule deadlocked (bug in the schedule generator)")
  makespan = max(t_stage)
  return {"step_time": makespan, "bubble_fraction": 1 - m * (f + b) / makespan, "in_flight": max_live[0]}


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
  if r == pp.SCOPE_FIRST:
    return float(np.mean([s == 0 for s in stages]))
  if r == pp.SCOPE_LAST:
    return float(np.mean([s == p - 1 for s in stages]))
  raise ValueError(r)


def schedule_of(cfg):
  """The pipeline schedule a config's step runs (parallelism/pipeline.py), or None when not pipelined."""
  if cfg.mesh.pipeline <= 1:
    return None
  return pp.make_schedule(cfg.mesh.schedule, cfg.mesh.pipeline, cfg.mesh.microbatches)


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
  """(forward, backward) seconds of one busy slot: the true branch of the pp_fwd_slot / pp_bwd_slot
  conditionals (0 when the program has none)."""
  out = {pp.SCOPE_FWD: 0.0, pp.SCOPE_BWD: 0.0}
  cache = {}
  for _, _, n in _conditionals(g):
    r = role(n.attribution.op_name)
    if r in out and len(n.branches) == 2:
      out[r] = max(out[r], timeline.schedule(g, chain, n.branches[1], cache).makespan)
  return out[pp.SCOPE_FWD], out[pp.SCOPE_BWD]


def lockstep_extra(sched, fwd_s: list, bwd_s: list, stage: int) -> float:
  """Seconds stage ``stage`` idles in lock-step ticks: sum over ticks of the busiest stage's slot work,
  minus its own (per-stage slot times ``fwd_s[s]``, ``bwd_s[s]``)."""
  f, b = np.asarray(fwd_s), np.asarray(bwd_s)
  work_TxP = (sched.fwd_TxP >= 0) * f[None, :] + (sched.bwd_TxP >= 0) * b[None, :]
  return float(work_TxP.max(axis=1).sum() - work_TxP[:, stage].sum())
