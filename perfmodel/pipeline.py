"""Pipeline-parallel schedules from per-stage costs: closed forms and an event simulation.

p stages, m micro-batches, per-micro-batch forward time f and backward time b per stage, v virtual
chunks per device (interleaved), P2P time c per boundary crossing.

  GPipe       T = (m + p - 1)(f + b),           bubble fraction (p-1)/(m+p-1), m micro-batches in flight
  1F1B        T = (m + p - 1)(f + b),           same bubble, only p micro-batches of activations live
  interleaved T = (m + (p-1)/v)(f + b),         bubble (p-1)/(v m + p - 1)  (Megatron-LM, Narayanan 2021)
The simulation (:func:`simulate`) executes the per-stage operation lists with dependencies
(forward of micro-batch i on stage s needs stage s-1; backward needs stage s+1) and returns the
makespan and per-stage idle time; tests check it reproduces the closed forms.
"""
from __future__ import annotations

import dataclasses


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
