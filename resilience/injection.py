"""Failure injection plan, scriptable from the config (extras.resilience.fail_at / fail_kind / fail_rank).

Kinds (what a real cluster loses):
  worker       SIGKILL of the training worker (process crash; the node is retired and swapped)
  node         SIGKILL of worker and agent (host loss: its shared memory and held replicas are gone)
  replication  the node dies while its snapshot is on the wire (agent-side fault point)
  recovery     a node dies; then a second node dies while the new generation is starting
  spare        SIGKILL of an idle spare (agent + warm standby); training must not notice
  two          two adjacent nodes die at once (memory tier needs replicas >= 2; else persistent tier)
  hang         SIGSTOP of a worker (alive but silent: found by heartbeat timeout, then SIGKILLed)
  random       one of worker/node/replication/hang (and two when replicas >= 2), drawn from fail_seed
"""
from __future__ import annotations

import dataclasses
import random
import signal
import time
from typing import List, Optional, Tuple

from resilience.fleet import Fleet, kill
from resilience.run_state import EventLog, Membership
from resilience.settings import HotswapSettings, items


@dataclasses.dataclass
class Fault:
  at_step: int
  kind: str
  rank: int
  fired: bool = False
  stage: int = 0  # 'recovery' has two stages
  t_fail: Optional[float] = None  # when it struck (a 'replication' fault: when its node reported the snapshot)
  detected: bool = False  # a failure claimed it (a 'spare' fault needs no recovery: claimed when fired)


def plan(s: HotswapSettings, total_steps: int) -> List[Fault]:
  steps = [int(x) for x in items(s.fail_at)]
  if not steps:
    return []
  kinds = items(s.fail_kind)
  if len(kinds) == 1:
    kinds = kinds * len(steps)
  if len(kinds) != len(steps):
    raise ValueError(f"extras.resilience.fail_kind has {len(kinds)} entries for {len(steps)} fail_at steps: "
                     "give one kind, or one per step")
  rng = random.Random(s.fail_seed)
  out = []
  for step, kind in zip(steps, kinds):
    if step < 0:
      step = rng.randrange(2, max(total_steps - 1, 3))
    if kind == "random":
      pool = ["worker", "node", "replication", "hang"] + (["two"] if s.replicas >= 2 else [])
      kind = rng.choice(pool)
    rank = s.fail_rank if s.fail_rank >= 0 else rng.randrange(s.nodes)
    out.append(Fault(int(step), kind, rank % s.nodes))
  return sorted(out, key=lambda f: f.at_step)


def random_campaign(n: int, total_steps: int, nodes: int, replicas: int, seed: int, kinds=None) -> dict:
  """fail_at / fail_kind lists for n failures spread over the run (for benchmarks)."""
  rng = random.Random(seed)
  kinds = kinds or ["worker", "node", "replication", "hang"] + (["two"] if replicas >= 2 else [])
  gap = max((total_steps - 4) // n, 2)
  at = [min(2 + i * gap + rng.randrange(gap), total_steps - 1) for i in range(n)]
  return {"fail_at": ",".join(map(str, at)), "fail_kind": ",".join(rng.choice(kinds) for _ in range(n)),
          "fail_rank": -1, "fail_seed": seed}


class Injector:
  """Controller side of injection: fires the plan's faults at their steps, and tells a failure it detects
  which of them it is (:meth:`take_detected`)."""

  def __init__(self, s: HotswapSettings, faults: List[Fault], fleet: Fleet, membership: Membership,
               events: EventLog):
    self.s, self.faults, self.fleet, self.membership, self.events = s, faults, fleet, membership, events

  def maybe_inject(self, step: int, recovering: bool):
    if self.membership.phase != "running" or recovering:
      return
    members, nodes = self.membership.members, self.fleet.nodes
    for f in self.faults:
      if f.fired or step < f.at_step:
        continue
      f.fired = True
      f.t_fail = time.time()
      name = members[f.rank]
      node = nodes[name]
      self.events.emit("inject", kind=f.kind, rank=f.rank, node=name, step=step)
      if f.kind == "worker":
        kill(node.worker_pid)
      elif f.kind in ("node", "recovery"):
        self.fleet.kill_node(name)
      elif f.kind == "hang":
        kill(node.worker_pid, signal.SIGSTOP)
      elif f.kind == "two":
        self.fleet.kill_node(name)
        self.fleet.kill_node(members[(f.rank + 1) % self.s.nodes])
      elif f.kind == "replication":
        self.fleet.send(name, {"type": "fault", "kind": "replication", "version": step + 1})
        f.t_fail = None  # set when that node reports the snapshot it dies sending
      elif f.kind == "spare":
        idle = self.fleet.spares()
        if idle:
          nodes[idle[0]].proc.kill()
          self.events.emit("inject_target", node=idle[0])
        f.detected = True  # no recovery expected
      return  # one fault per step

  def on_stored(self, msg: dict):
    """A 'replication' fault's failure time is when its node reports the snapshot it dies sending."""
    for f in self.faults:
      if f.fired and f.kind == "replication" and f.t_fail is None and \
         self.membership.members[f.rank] in self.fleet.nodes and msg["rank"] == f.rank:
        f.t_fail = msg["t"]

  def on_started(self, started_node: str, recovery: Optional[dict]):
    """'recovery' kind, stage 2: a survivor dies while the new generation (of ``recovery``) is starting."""
    if recovery is None:
      return
    rank = self.membership.rank_of(started_node)
    for f in self.faults:
      if f.kind == "recovery" and f.fired and f.stage == 0:
        # the victim is rank+2: a survivor whose replica holder (rank+3) is alive, so the memory tier
        # can still serve it (rank+1 would lose its only replica with the first node when r=1)
        if "swaps" not in recovery or rank != (f.rank + 2) % self.s.nodes:
          continue
        f.stage = 1
        self.events.emit("inject", kind="recovery-stage2", node=started_node, rank=rank)
        self.fleet.kill_node(started_node)

  def take_detected(self) -> Tuple[Optional[float], List[str]]:
    """The fired faults no failure has claimed yet, now claimed: (the last one's failure time, their kinds)."""
    injected = [f for f in self.faults if f.fired and not f.detected]
    t_inj = None
    for f in injected:
      f.detected = True
      t_inj = f.t_fail
    return t_inj, [f.kind for f in injected]
