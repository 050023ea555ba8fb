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
  # Persistent tier: async orbax save every N steps (0 = off). It serves what the memory tier cannot (the
  # controller or every holder of a shard lost) and a rerun with the same workdir resumes from it.
  persist_every: int = 10
  persist_probe: bool = False  # benchmark: save every 2N steps only, so N-step windows with/without a save alternate
  overhead_probe_block: int = 0  # >0: alternate blocks of N steps with the layer on / off (overhead ratio)
  chunk_mb: int = 4  # replication message chunk size
  compile_cache_dir: str = ""  # "" -> <workdir>/jax_cache (shared by all nodes, warms the spares)
  wall_timeout_s: float = 900.0  # hard limit on the whole run (every child is SIGKILLed after it)
  controller_timeout_s: float = 30.0  # an agent that hears nothing from the controller this long cleans up and exits
  log_level: str = "INFO"


def from_config(cfg: config_lib.Config) -> HotswapSettings:
  return from_dict(config_lib.extras(cfg, "resilience"))


# lowest allowed value of numeric settings (exclusive for the floats marked True)
_LOW = {"spares": (0, False), "heartbeat_s": (0, True), "heartbeat_timeout_s": (0, True), "step_timeout_s": (0, True),
        "startup_timeout_s": (0, True), "persist_every": (0, False), "overhead_probe_block": (0, False),
        "chunk_mb": (1, False), "wall_timeout_s": (0, True), "controller_timeout_s": (0, True), "fail_rank": (-1, False)}


def _typed(name: str, v, default):
  """The value as the field's type (ints accepted for floats, integral floats for ints), else ConfigError."""
  if isinstance(default, bool):
    if isinstance(v, bool):
      return v
  elif isinstance(default, int):
    if isinstance(v, int) and not isinstance(v, bool):
      return v
    if isinstance(v, float) and v.is_integer():
      return int(v)
  elif isinstance(default, float):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
      return float(v)
  elif isinstance(default, str):
    if isinstance(v, str):
      return v
  else:
    return v
  raise config_lib.ConfigError(f"extras.resilience.{name} must be {type(default).__name__}, got {v!r}")


def from_dict(d: Mapping[str, Any]) -> HotswapSettings:
  ce = config_lib.ConfigError
  fields = {f.name: f.default for f in dataclasses.fields(HotswapSettings)}
  unknown = sorted(set(d) - set(fields))
  if unknown:
    raise ce(f"unknown extras.resilience key(s) {unknown}; known: {sorted(fields)}")
  loose = ("fail_at", "fail_kind")  # a step / kind, or lists of them
  s = HotswapSettings(**{k: v if k in loose else _typed(k, v, fields[k]) for k, v in dict(d).items()})
  for name, (low, exclusive) in _LOW.items():
    v = getattr(s, name)
    if v < low or (exclusive and v == low):
      raise ce(f"extras.resilience.{name}={v!r} is out of range: it must be {'>' if exclusive else '>='} {low}")
  kinds = items(s.fail_kind)
  bad = [k for k in kinds if k not in FAIL_KINDS]
  if bad:
    raise ce(f"extras.resilience.fail_kind {bad} unknown; choose from {FAIL_KINDS}")
  try:
    steps = [int(x) for x in items(s.fail_at)]
  except (TypeError, ValueError):
    raise ce(f"extras.resilience.fail_at={s.fail_at!r} must be a step, a comma-separated list of steps, "
             f"or -1 (a random step)") from None
  if any(x < -1 for x in steps):
    raise ce(f"extras.resilience.fail_at={s.fail_at!r}: steps must be >= 0 (or -1 for a random step)")
  if steps and len(kinds) not in (1, len(steps)):
    raise ce(f"extras.resilience.fail_kind has {len(kinds)} entries for {len(steps)} fail_at steps: give one "
             f"kind, or one per step")
  if s.nodes < 2:
    raise ce("extras.resilience.nodes must be >= 2 (hot swap needs peers to hold replicas)")
  if not 1 <= s.replicas < s.nodes:
    raise ce(f"extras.resilience.replicas={s.replicas} must be in [1, nodes-1={s.nodes - 1}]")
  if s.fail_rank >= s.nodes:
    raise ce(f"extras.resilience.fail_rank={s.fail_rank} must be < nodes={s.nodes} (or -1 for a random rank)")
  if s.heartbeat_timeout_s <= s.heartbeat_s:
    raise ce(f"extras.resilience.heartbeat_timeout_s={s.heartbeat_timeout_s} must exceed heartbeat_s={s.heartbeat_s}")
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
