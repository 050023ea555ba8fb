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
import os
import random
import signal
import time
from typing import List, Optional

from resilience.settings import HotswapSettings, items


@dataclasses.dataclass
class Fault:
  at_step: int
  kind: str
  rank: int
  fired: bool = False
  stage: int = 0  # 'recovery' has two stages


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


class InjectorMixin:
  """Controller side of injection (mixed into Controller): fires the plan's faults at their steps."""

  def _kill(self, pid: Optional[int], sig=signal.SIGKILL):
    if pid:
      try:
        os.kill(pid, sig)
      except ProcessLookupError:
        pass

  def _kill_node(self, name: str):
    node = self.nodes[name]
    self._kill(node.worker_pid)
    node.proc.kill()

  def maybe_inject(self, step: int):
    if self.state != "running" or self.rec is not None:
      return
    for f in self.faults:
      if f.fired or step < f.at_step:
        continue
      f.fired = True
      f.__dict__["t_fail"] = time.time()
      name = self.members[f.rank]
      node = self.nodes[name]
      self.event("inject", kind=f.kind, rank=f.rank, node=name, step=step)
      if f.kind == "worker":
        self._kill(node.worker_pid)
      elif f.kind in ("node", "recovery"):
        self._kill_node(name)
      elif f.kind == "hang":
        self._kill(node.worker_pid, signal.SIGSTOP)
      elif f.kind == "two":
        self._kill_node(name)
        self._kill_node(self.members[(f.rank + 1) % self.s.nodes])
      elif f.kind == "replication":
        self.send(name, {"type": "fault", "kind": "replication", "version": step + 1})
        f.__dict__["t_fail"] = None  # set when that node reports the snapshot it dies sending
      elif f.kind == "spare":
        idle = self.spares()
        if idle:
          self.nodes[idle[0]].proc.kill()
          self.event("inject_target", node=idle[0])
        f.__dict__["detected"] = True  # no recovery expected
      return  # one fault per step

  def maybe_inject_replication_time(self, msg: dict):
    for f in self.faults:
      if f.fired and f.kind == "replication" and f.__dict__.get("t_fail") is None and \
         self.members[f.rank] in self.nodes and msg["rank"] == f.rank:
        f.__dict__["t_fail"] = msg["t"]

  def maybe_inject_recovery_stage(self, started_node: str):
    """'recovery' kind, stage 2: a survivor dies while the new generation is starting."""
    if self.rec is None:
      return
    for f in self.faults:
      if f.kind == "recovery" and f.fired and f.stage == 0:
        # the victim is rank+2: a survivor whose replica holder (rank+3) is alive, so the memory tier
        # can still serve it (rank+1 would lose its only replica with the first node when r=1)
        if "swaps" not in self.rec or self.rank_of(started_node) != (f.rank + 2) % self.s.nodes:
          continue
        f.stage = 1
        self.event("inject", kind="recovery-stage2", node=started_node, rank=self.rank_of(started_node))
        self._kill_node(started_node)
