"""Hot-swap settings: the ``extras.resilience`` section of a config, typed.

Read with :func:`from_config`; every key is optional. Unknown keys are errors (a typo must never
silently disable a failure injection).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from framework import config as config_lib

FAIL_KINDS = ("worker", "node", "replication", "recovery", "spare", "two", "hang", "random")


@dataclasses.dataclass(frozen=True)
class HotswapSettings:
  nodes: int = 4  # training nodes (one jax process each on localhost)
  spares: int = 1  # warm spare nodes
  replicas: int = 1  # r: buddy copies of every node's snapshot (ring: rank k -> k+1..k+r)
  respawn_spares: bool = False  # a retired node is "repaired": a fresh spare joins the pool
  # Failure injection. fail_at: step (int), list of steps, or -1 = one random step; fail_kind one of
  # FAIL_KINDS (or a list, one per fail_at); fail_rank -1 = random rank.
  fail_at: Any = ""  # "12" or "5,20" (or an int / list); "-1" = a random step
  fail_kind: Any = "worker"  # one kind, or "worker,node" (one per fail_at)
  fail_rank: int = -1
  fail_seed: int = 0
  heartbeat_s: float = 0.25  # worker/agent heartbeat period
  heartbeat_timeout_s: float = 2.0  # a worker silent this long is hung (SIGSTOP, deadlock)
  step_timeout_s: float = 60.0  # no step progress from anyone this long -> restart all ranks
  startup_timeout_s: float = 600.0  # agents up, standbys warm, a generation compiled (cold compiles are slow)
  snapshot: bool = True  # the replicated in-memory layer (False = plain donated step, no snapshots)
  persist_every: int = 0  # orbax checkpoint every N steps (persistent tier); 0 = off
  overhead_probe_block: int = 0  # >0: alternate blocks of N steps with the layer on / off (overhead ratio)
  chunk_mb: int = 4  # replication message chunk size
  compile_cache_dir: str = ""  # "" -> <workdir>/jax_cache (shared by all nodes, warms the spares)
  wall_timeout_s: float = 900.0  # hard limit on the whole run (every child is SIGKILLed after it)
  log_level: str = "INFO"


def from_config(cfg: config_lib.Config) -> HotswapSettings:
  return from_dict(config_lib.extras(cfg, "resilience"))


def from_dict(d: Mapping[str, Any]) -> HotswapSettings:
  known = {f.name for f in dataclasses.fields(HotswapSettings)}
  unknown = sorted(set(d) - known)
  if unknown:
    raise config_lib.ConfigError(f"unknown extras.resilience key(s) {unknown}; known: {sorted(known)}")
  s = HotswapSettings(**dict(d))
  kinds = items(s.fail_kind)
  bad = [k for k in kinds if k not in FAIL_KINDS]
  if bad:
    raise config_lib.ConfigError(f"extras.resilience.fail_kind {bad} unknown; choose from {FAIL_KINDS}")
  if s.nodes < 2:
    raise config_lib.ConfigError("extras.resilience.nodes must be >= 2 (hot swap needs peers to hold replicas)")
  if not 1 <= s.replicas < s.nodes:
    raise config_lib.ConfigError(f"extras.resilience.replicas={s.replicas} must be in [1, nodes-1={s.nodes - 1}]")
  return s


def items(v) -> list:
  """'5,9' / 5 / [5, 9] / '' -> list (config-file overrides arrive as strings)."""
  if v is None or v == "" or v == ():
    return []
  if isinstance(v, str):
    return [x.strip() for x in v.split(",") if x.strip()]
  if isinstance(v, (list, tuple)):
    return list(v)
  return [v]


def to_dict(s: HotswapSettings) -> dict:
  return dataclasses.asdict(s)
