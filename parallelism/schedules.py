"""Pipeline schedules as data: which unit of work each stage runs in each lock-step tick, checked.

A pipeline of ``P`` stages (devices on the ``pipeline`` axis) with ``v`` virtual stages per device holds the layer
stack as ``v x P`` chunks of ``L/(vP)`` layers; chunk ``j`` of device ``s`` is virtual stage ``q = jP + s`` (placement
round-robin, Megatron's interleaved layout and MaxText's circular one), so a micro-batch goes around the ring ``v``
times. A *unit* is one micro-batch through one chunk. Every tick, each stage runs at most one unit's forward (the
*forward slot*) and one unit's backward (the *backward slot*), then sends an activation to stage ``s+1`` and a
cotangent to stage ``s-1`` (around the ring when ``v > 1``). The engine (parallelism/pipeline.py) runs any table
:func:`check_schedule` accepts.

Unit order on a stage: micro-batches in groups of ``P``; within a group, forwards go chunk by chunk upwards
(Megatron's interleaved order), backwards chunk by chunk downwards. Stage ``s`` runs the ``k``-th forward unit at tick
``k + s`` and the ``k``-th backward unit at tick ``b0 + k + (P-1-s)``, so an activation is used the tick after it
arrives and nothing waits in a receive buffer. ``v > 1`` needs ``M`` to be a multiple of ``P`` (as Megatron's
interleaved schedule does): then the unit that comes back around the ring reaches stage 0 exactly when it is due.

* ``gpipe``: all forwards, then all backwards: ``b0 = vM + P - 1``, ``2(vM + P - 1)`` ticks. With ``v > 1`` this is
  MaxText's circular pipeline (``num_pipeline_repeats = v``), whose backward is the reverse of its forward loop.
* ``1f1b``: a unit's backward starts as soon as its last virtual stage is done: ``b0 = vP - 1``,
  ``vM + vP + P - 2`` ticks (``M + 2(P-1)`` for ``v = 1``). With ``v > 1`` this is Megatron's interleaved 1F1B
  (``--num-layers-per-virtual-pipeline-stage``, ``vpp = v``).

Slots cost a chunk's forward ``F/v`` and backward ``B/v`` (``F``, ``B``: one micro-batch through a whole stage);
idle slots are skipped, so a tick lasts as long as its busiest stage (:meth:`Schedule.bubble_fraction`). For both
schedules the bubble is ``(P-1)/(vM + P - 1)`` of the step, ``(P-1)/(vM)`` relative to the ideal ``M(F+B)``
(:func:`bubble_formula`; tests/parallelism/test_schedules.py checks the tables against it).

Stash: a unit's saved activations live from its forward to its backward in one of ``n_slots`` slots per stage,
assigned by the table (lowest free slot). ``n_slots`` is the largest number of units in flight on a stage:
``vM`` for gpipe, ``min(vM, (v+1)P - 1)`` for 1f1b on stage 0 (``min(M, 2P-1)`` for ``v = 1``; Megatron's
asynchronous 1F1B holds ``P``, its interleaved one the same ``(v+1)P - 1`` units as here).
"""
from __future__ import annotations

import dataclasses

import numpy as np

SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per tick ``t`` and stage ``s``: the micro-batch (-1 = idle), chunk and stash slot of each slot's unit."""
  name: str
  n_stages: int
  n_micro: int
  n_chunks: int  # virtual stages per device (v)
  fwd_TxP: np.ndarray
  bwd_TxP: np.ndarray
  fwd_chunk_TxP: np.ndarray
  bwd_chunk_TxP: np.ndarray
  fwd_slot_TxP: np.ndarray
  bwd_slot_TxP: np.ndarray
  n_slots: int  # activation stash slots per stage
  n_head_slots: int  # last-stage outputs kept for the head: 1 when the head runs in the tick of its forward

  @property
  def n_ticks(self) -> int:
    return int(self.fwd_TxP.shape[0])

  def tick_costs(self, fwd_cost: float = 1.0, bwd_cost: float = 2.0, masked: bool = False) -> np.ndarray:
    """Length of each lock-step tick (its busiest stage) for one micro-batch's stage forward / backward costs.
    ``masked``: the jit form, where every tick runs both slots on every stage (no skipping)."""
    f, b = fwd_cost / self.n_chunks, bwd_cost / self.n_chunks
    if masked:
      return np.full(self.n_ticks, f + b)
    return np.max((self.fwd_TxP >= 0) * f + (self.bwd_TxP >= 0) * b, axis=1)

  def bubble_fraction(self, fwd_cost: float = 1.0, bwd_cost: float = 2.0, masked: bool = False) -> float:
    """Idle share of stage-time in lock-step ticks."""
    return float(1.0 - self.n_micro * (fwd_cost + bwd_cost) / self.tick_costs(fwd_cost, bwd_cost, masked).sum())

  def peak_in_flight(self) -> list:
    """Per stage: the most units whose forward ran but whose backward has not finished."""
    out = []
    for s in range(self.n_stages):
      live, peak = 0, 0
      for t in range(self.n_ticks):
        live += int(self.fwd_TxP[t, s] >= 0)
        peak = max(peak, live)
        live -= int(self.bwd_TxP[t, s] >= 0)
      out.append(peak)
    return out

  def virtual_stage(self, chunk_TxP: np.ndarray) -> np.ndarray:
    """Virtual stage ``jP + s`` of each slot's unit (meaningless where the slot is idle)."""
    return chunk_TxP * self.n_stages + np.arange(self.n_stages)[None, :]


def bubble_formula(name: str, n_stages: int, n_micro: int, n_chunks: int = 1) -> float:
  """Closed-form bubble of a schedule with idle slots skipped: ``(P-1)/(vM + P - 1)`` of the step."""
  if name not in SCHEDULES:
    raise ValueError(f"mesh.schedule={name!r}; choose one of {SCHEDULES}")
  p, m, v = n_stages, n_micro, n_chunks
  return (p - 1) / (v * m + p - 1)


def _unit_orders(p: int, m: int, v: int) -> tuple:
  """(forward order, backward order) of (micro-batch, chunk) units on a stage."""
  fwd, bwd = [], []
  for g in range(0, m, p):
    group = range(g, min(g + p, m))
    fwd += [(mb, j) for j in range(v) for mb in group]
    bwd += [(mb, j) for j in reversed(range(v)) for mb in group]
  return fwd, bwd


def make_schedule(name: str, n_stages: int, n_micro: int, n_chunks: int = 1) -> Schedule:
  if name not in SCHEDULES:
    raise ValueError(f"mesh.schedule={name!r}; choose one of {SCHEDULES}")
  p, m, v = n_stages, n_micro, n_chunks
  if v > 1 and m % p:
    raise ValueError(f"{v} virtual stages need micro-batches in groups of the {p} stages: "
                     f"mesh.microbatches={m} must be a multiple of mesh.pipeline={p}")
  b0 = v * m + p - 1 if name == "gpipe" else v * p - 1
  n_ticks = b0 + v * m + p - 1
  tables = {k: -np.ones((n_ticks, p), np.int32) for k in ("fm", "fj", "fk", "bm", "bj", "bk")}
  fwd_order, bwd_order = _unit_orders(p, m, v)
  for s in range(p):
    for k, (mb, j) in enumerate(fwd_order):
      tables["fm"][k + s, s], tables["fj"][k + s, s] = mb, j
    for k, (mb, j) in enumerate(bwd_order):
      tables["bm"][b0 + k + p - 1 - s, s], tables["bj"][b0 + k + p - 1 - s, s] = mb, j
  # Stash slots: lowest free slot at the forward, freed by the backward (a tick runs its forward slot first).
  n_slots = 0
  for s in range(p):
    free, holder = [], {}
    for t in range(n_ticks):
      if tables["fm"][t, s] >= 0:
        slot = min(free) if free else len(holder) + len(free)
        if slot in free:
          free.remove(slot)
        holder[(tables["fm"][t, s], tables["fj"][t, s])] = slot
        tables["fk"][t, s] = slot
        n_slots = max(n_slots, slot + 1)
      if tables["bm"][t, s] >= 0:
        slot = holder.pop((tables["bm"][t, s], tables["bj"][t, s]))
        tables["bk"][t, s] = slot
        free.append(slot)
  # The head runs in the backward slot of the last virtual stage; its input waits there unless it is due
  # in the same tick (1f1b).
  last = [(int(np.argmax((tables["fm"][:, p - 1] == mb) & (tables["fj"][:, p - 1] == v - 1))),
           int(np.argmax((tables["bm"][:, p - 1] == mb) & (tables["bj"][:, p - 1] == v - 1)))) for mb in range(m)]
  n_head = 1 if all(tf == tb for tf, tb in last) else n_slots
  sched = Schedule(name, p, m, v, tables["fm"], tables["bm"], tables["fj"], tables["bj"], tables["fk"],
                   tables["bk"], n_slots, n_head)
  check_schedule(sched)
  return sched


def check_schedule(s: Schedule) -> None:
  """Proves the properties the engine relies on; raises AssertionError naming the violation."""
  p, m, v = s.n_stages, s.n_micro, s.n_chunks
  where_f, where_b = {}, {}
  for t in range(s.n_ticks):
    for st in range(p):
      if s.fwd_TxP[t, st] >= 0:
        where_f[(int(s.fwd_TxP[t, st]), int(s.fwd_chunk_TxP[t, st]) * p + st)] = t
      if s.bwd_TxP[t, st] >= 0:
        where_b[(int(s.bwd_TxP[t, st]), int(s.bwd_chunk_TxP[t, st]) * p + st)] = t
  want = {(mb, q) for mb in range(m) for q in range(v * p)}
  assert set(where_f) == set(where_b) == want and (s.fwd_TxP >= 0).sum() == (s.bwd_TxP >= 0).sum() == len(want), \
      "every (micro-batch, virtual stage) needs one forward and one backward"
  for (mb, q), t in where_f.items():
    if q > 0:
      assert where_f[(mb, q - 1)] == t - 1, f"forward {mb} on virtual stage {q} must follow virtual stage {q - 1} by one tick"
    assert where_b[(mb, q)] >= t, f"backward {mb} on virtual stage {q} before its forward"
  for (mb, q), t in where_b.items():
    if q < v * p - 1:
      assert where_b[(mb, q + 1)] == t - 1, f"backward {mb} on virtual stage {q} must follow virtual stage {q + 1} by one tick"
  # Head input: every forward on the last stage writes its output to head slot fk (or 0 when there is one); the
  # last virtual stage's backward reads it.
  head, last = {}, p - 1
  for t in range(s.n_ticks):
    if s.fwd_TxP[t, last] >= 0:
      slot = int(s.fwd_slot_TxP[t, last]) if s.n_head_slots > 1 else 0
      assert slot < s.n_head_slots, f"head slot {slot} out of range at tick {t}"
      head[slot] = (int(s.fwd_TxP[t, last]), int(s.fwd_chunk_TxP[t, last]))
    if s.bwd_TxP[t, last] >= 0 and s.bwd_chunk_TxP[t, last] == v - 1:
      unit = (int(s.bwd_TxP[t, last]), v - 1)
      slot = int(s.bwd_slot_TxP[t, last]) if s.n_head_slots > 1 else 0
      assert head.get(slot) == unit, f"head input of micro-batch {unit[0]} overwritten before its backward at tick {t}"
  for st in range(p):  # stash: a slot is never overwritten while its unit awaits its backward
    holder = {}
    for t in range(s.n_ticks):
      if s.fwd_TxP[t, st] >= 0:
        unit, slot = (int(s.fwd_TxP[t, st]), int(s.fwd_chunk_TxP[t, st])), int(s.fwd_slot_TxP[t, st])
        assert 0 <= slot < s.n_slots and holder.get(slot) is None, f"stash slot {slot} of stage {st} overwritten at tick {t}"
        holder[slot] = unit
      if s.bwd_TxP[t, st] >= 0:
        unit, slot = (int(s.bwd_TxP[t, st]), int(s.bwd_chunk_TxP[t, st])), int(s.bwd_slot_TxP[t, st])
        assert holder.get(slot) == unit, f"stash slot of unit {unit} of stage {st} lost at tick {t}"
        holder[slot] = None
