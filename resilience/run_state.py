"""The controller's run state, grouped by what it describes; the controller's parts receive the pieces they use.

* :class:`Node`        one agent process (a member, a spare, or retired) as the controller sees it;
* :class:`Membership`  which node runs which rank, the generation number, what the job is doing;
* :class:`Progress`    the running generation's progress (a fresh one per generation);
* :class:`Commits`     versions stored, acknowledged by buddies, committed (durable in memory);
* :class:`Trajectory`  what the whole run computed and how fast: losses, step times, start-up timings;
* :class:`EventLog`    the events, in memory and in ``hotswap_events.jsonl``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import time
from typing import Dict, List, Optional

log = logging.getLogger("prismllm.resilience")


class Node:
  def __init__(self, name: str, proc: subprocess.Popen):
    self.name, self.proc = name, proc
    self.data_addr: Optional[str] = None
    self.alive = True
    self.role = "spare"  # member | spare | retired
    self.last_hb = time.time()
    self.standby_ready = False
    self.worker_pid: Optional[int] = None
    self.hello = False
    self.released = False  # a retired node told to exit once the replicas it held were committed elsewhere


@dataclasses.dataclass
class Membership:
  members: List[str] = dataclasses.field(default_factory=list)  # rank -> node name
  gen: int = -1
  phase: str = "starting"  # starting | running | fencing | done

  def rank_of(self, name: str) -> Optional[int]:
    return self.members.index(name) if name in self.members else None


@dataclasses.dataclass
class Progress:
  started_at: float = 0.0
  last_progress: float = dataclasses.field(default_factory=time.time)
  max_step: int = 0
  worker_hb: Dict[int, float] = dataclasses.field(default_factory=dict)
  done: Dict[int, dict] = dataclasses.field(default_factory=dict)  # rank -> its 'done' (or 'stopped') message
  first_steps: set = dataclasses.field(default_factory=set)  # ranks that reported a step in this generation
  pending_error: Optional[dict] = None  # a worker error not (yet) explained by a failure

  @classmethod
  def starting(cls, version: int) -> "Progress":
    now = time.time()
    return cls(started_at=now, last_progress=now, max_step=version)

  def training(self, nodes: int) -> bool:
    """Every rank of this generation has reported a step."""
    return len(self.first_steps) == nodes


@dataclasses.dataclass
class Commits:
  """Version v is committed once every rank stored its own copy and ``replicas`` buddies acknowledged it."""
  committed: int = -1
  holders: Dict[int, set] = dataclasses.field(default_factory=dict)  # rank -> nodes holding its committed replica
  owner: Dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> node holding its own committed copy
  stored: Dict[int, set] = dataclasses.field(default_factory=dict)  # version -> ranks
  acks: Dict[int, Dict[int, set]] = dataclasses.field(default_factory=dict)  # version -> origin rank -> nodes

  def new_generation(self, plan: dict):
    if plan["tier"] != "memory":  # restored from disk / step 0: versions restart there, memory copies are void
      self.committed = plan["version"] if plan["tier"] == "persistent" else -1
      self.holders, self.owner = {}, {}
    # acks and stores of uncommitted versions belong to the dead generation
    self.stored, self.acks = {}, {}

  def try_commit(self, v: int, members: List[str], replicas: int) -> bool:
    """Commits v if it is complete; True when it did."""
    n = len(members)
    if v <= self.committed or len(self.stored.get(v, ())) < n:
      return False
    acks = self.acks.get(v, {})
    if not all(len(acks.get(k, ())) >= replicas for k in range(n)):
      return False
    self.committed = v
    self.holders = {k: set(acks[k]) for k in range(n)}
    self.owner = {k: members[k] for k in range(n)}
    for old in [x for x in self.stored if x < v]:
      self.stored.pop(old, None)
      self.acks.pop(old, None)
    return True


@dataclasses.dataclass
class Trajectory:
  losses: Dict[int, float] = dataclasses.field(default_factory=dict)  # step -> rank 0's loss
  loss_gen: Dict[int, int] = dataclasses.field(default_factory=dict)  # generation that first reported each step
  loss_mismatch: List[int] = dataclasses.field(default_factory=list)
  recompute_checks: int = 0  # reports of a step an earlier generation had computed, compared bit for bit
  max_step: int = 0
  step_times: List[dict] = dataclasses.field(default_factory=list)
  start_timings: Dict[int, dict] = dataclasses.field(default_factory=dict)  # rank -> generation 0's phases
  t_first_step: Optional[float] = None
  t_last_step: float = 0.0

  def record_step(self, msg: dict, gen: int) -> bool:
    """A worker's step report; True when it is rank 0's (the one the metrics log)."""
    step, rank = msg["step"], msg["rank"]
    if step in self.losses:
      if self.losses[step] != msg["loss"]:  # ranks disagree, or a recomputed step differs
        self.loss_mismatch.append(step)
      if self.loss_gen[step] < gen:
        self.recompute_checks += 1
    if rank == 0:
      self.losses[step] = msg["loss"]
      self.loss_gen[step] = gen
      self.step_times.append({"gen": gen, "step": step, "dt": msg["dt"], "on": msg["on"],
                              "transition": msg["transition"], "first": msg["first"],
                              "after_save": msg.get("after_save", False), "t": msg["t"]})
    self.max_step = max(self.max_step, step)
    self.t_first_step = self.t_first_step or time.time()
    self.t_last_step = time.time()
    return rank == 0


class EventLog:
  """Events stamped with seconds since ``t0`` and the current generation (read from ``membership``)."""

  def __init__(self, path: str, t0: float, membership: Membership):
    self.path, self.t0, self.membership = path, t0, membership
    self.records: List[dict] = []
    self.f = open(path, "a")

  def emit(self, what: str, **kw):
    rec = {"t": round(time.time() - self.t0, 4), "event": what, "gen": self.membership.gen, **kw}
    self.records.append(rec)
    self.f.write(json.dumps(rec, default=str) + "\n")
    self.f.flush()
    log.info("%s %s", what, {k: v for k, v in kw.items() if k != "trace"})

  def first(self, what: str) -> Optional[dict]:
    return next((e for e in self.records if e["event"] == what), None)

  def close(self):
    self.f.close()
