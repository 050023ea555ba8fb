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
from typing import List

from resilience.settings import HotswapSettings


@dataclasses.dataclass
class Fault:
  at_step: int
  kind: str
  rank: int
  fired: bool = False
  stage: int = 0  # 'recovery' has two stages


def plan(s: HotswapSettings, total_steps: int) -> List[Fault]:
  steps = [int(x) for x in _items(s.fail_at)]
  if not steps:
    return []
  kinds = _items(s.fail_kind)
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


def _items(v) -> list:
  """'5,9' / 5 / [5, 9] / '' -> list (config-file overrides arrive as strings)."""
  if v is None or v == "" or v == ():
    return []
  if isinstance(v, str):
    return [x.strip() for x in v.split(",") if x.strip()]
  if isinstance(v, (list, tuple)):
    return list(v)
  return [v]


def random_campaign(n: int, total_steps: int, nodes: int, replicas: int, seed: int, kinds=None) -> dict:
  """fail_at / fail_kind lists for n failures spread over the run (for benchmarks)."""
  rng = random.Random(seed)
  kinds = kinds or ["worker", "node", "replication", "hang"] + (["two"] if replicas >= 2 else [])
  gap = max((total_steps - 4) // n, 2)
  at = [min(2 + i * gap + rng.randrange(gap), total_steps - 1) for i in range(n)]
  return {"fail_at": ",".join(map(str, at)), "fail_kind": ",".join(rng.choice(kinds) for _ in range(n)),
          "fail_rank": -1, "fail_seed": seed}
