"""Which branch of each ``conditional`` runs, and how often: branch weights for prediction.

A compiled program decides its conditionals at run time, so a compile-only prediction needs a rule per
conditional. Two are used:

* **pipeline schedule** (parallelism/pipeline.py): the pipelined step skips idle work with ``lax.cond``
  under named scopes (``pp_fwd_slot``, ``pp_bwd_slot``, ``pp_first_stage``, ``pp_last_stage``) that the
  compiled conditionals keep in their op_name. The schedule table says on how many of the T ticks stage s
  has forward / backward work (M each), and which stage is first / last, so each branch's expected
  executions per visit are exact: forward slot [1 - M/T, M/T] (false, true). ``stage=None`` averages over
  stages (what N virtual CPU devices on one core add up to); ``stage=s`` is that stage's program.
* otherwise the **costliest branch** (an upper bound; counted in the result).

:func:`lockstep_extra` adds what the per-stage sum leaves out on parallel hardware: ticks are lock-step
(each ends with a point-to-point send every stage waits for), so a tick lasts as long as its busiest stage;
the bubble is the sum over ticks of that maximum minus the stage's own work.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from perfmodel import timeline
from perfmodel.graph import ExecGraph


def _scopes():
  from parallelism import pipeline as pp  # noqa: PLC0415
  return (pp.SCOPE_FWD, pp.SCOPE_BWD, pp.SCOPE_FIRST, pp.SCOPE_LAST)


def role(op_name: str) -> Optional[str]:
  """The innermost pipeline scope in an op_name (the predicate of that conditional), or None."""
  best, pos = None, -1
  for sc in _scopes():
    i = op_name.rfind(sc + "/")
    if i > pos:
      best, pos = sc, i
  return best


def true_fraction(r: str, sched, stage: Optional[int]) -> float:
  """Share of visits on which a conditional of pipeline role ``r`` takes its true branch."""
  from parallelism import pipeline as pp  # noqa: PLC0415
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
  from parallelism.pipeline import make_schedule  # noqa: PLC0415
  return make_schedule(cfg.mesh.schedule, cfg.mesh.pipeline, cfg.mesh.microbatches)


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
  from parallelism import pipeline as pp  # noqa: PLC0415
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
