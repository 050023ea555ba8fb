"""Recovery: fence the failed generation, swap spares in, choose the restore tier, time the breakdown.

:class:`Recovery` holds the recovery in progress (``current``, None while training runs) and the finished ones'
reports (``reports``, the summary's ``recoveries``). It changes the membership (retires failed nodes, swaps
spares in, sets the phase to fencing) and reads the commits; the controller starts the next generation with the
plan :meth:`Recovery.advance` returns.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

from framework import checkpoint as ckpt_lib
from resilience.fleet import Fleet
from resilience.run_state import Commits, EventLog, Membership
from resilience.settings import HotswapSettings


class RunFailed(RuntimeError):
  """The job cannot continue (no spare left, a bug, a timeout); the message says what to change."""


class Recovery:
  def __init__(self, s: HotswapSettings, workdir: str, fleet: Fleet, membership: Membership, commits: Commits,
               events: EventLog):
    self.s, self.workdir, self.fleet, self.membership, self.commits, self.events = \
        s, workdir, fleet, membership, commits, events
    self.current: Optional[dict] = None
    self.reports: List[dict] = []

  def begin(self, ranks: set, cause: str, t_fail: float, last_step: int, force_tier: Optional[str] = None,
            injected: Sequence[str] = ()):
    """A failure (or one more during a recovery): retire the failed ranks' nodes and fence every worker.
    ``injected``: the kinds of the planned faults this failure is (reported with the recovery)."""
    now = time.time()
    nodes, members = self.fleet.nodes, self.membership.members
    if self.current is None:
      self.current = {"t_fail": t_fail, "t_detect": now, "failed": set(), "causes": [], "last_step": last_step,
                      "tier_forced": None, "n_restarts": 0}
      self.events.emit("failure_detected", ranks=sorted(ranks), cause=cause, detect_s=round(now - t_fail, 4))
    else:
      self.current["n_restarts"] += 1
      self.events.emit("failure_during_recovery", ranks=sorted(ranks), cause=cause)
    rec = self.current
    rec["failed"] |= set(ranks)
    rec["causes"].append(cause)
    if force_tier:
      rec["tier_forced"] = force_tier
    self.membership.phase = "fencing"
    for r in ranks:  # retire failed nodes (a crashed worker may mean bad hardware: never reuse it here)
      node = nodes[members[r]]
      if node.role == "member":
        # a retired node whose agent lives keeps serving the replicas it holds until the new generation
        # commits (released by the controller on commit), so a second failure meanwhile can still use them
        node.role = "retired"
        self.fleet.replenish()
    rec["kills_pending"] = set()
    for name in members:  # fence: every worker of this generation, failed node's included
      if nodes[name].alive:
        self.fleet.send(name, {"type": "kill_worker", "gen": self.membership.gen})
        rec["kills_pending"].add(name)
    rec.pop("fetch_pending", None)
    rec.pop("plan", None)
    rec.pop("first_step_t", None)
    rec.pop("timings", None)
    rec.setdefault("injected", []).extend(injected)

  def on_killed(self, name: str):
    if self.current is not None:
      self.current["kills_pending"].discard(name)

  def quarantine_later(self, step: int, why: str):
    """A bad persistent step: moved aside once the generation is fenced (advance), then the next older is used."""
    self.current.setdefault("quarantine", []).append((step, why))

  def advance(self) -> Optional[dict]:
    """The restore plan once the old generation is fenced and the spares have their replicas, else None."""
    rec, nodes, members = self.current, self.fleet.nodes, self.membership.members
    if any(nodes[n].alive for n in rec["kills_pending"]):
      return None
    rec.setdefault("t_fenced", time.time())
    for step, why in rec.pop("quarantine", []):  # set aside (kept), not deleted
      moved = ckpt_lib.quarantine(ckpt_lib.checkpoint_dir(self.workdir), step, why)
      self.events.emit("checkpoint_quarantined", step=step, why=why, moved_to=moved)
    if "plan" not in rec:
      # assign spares to every failed rank whose member is retired
      need = [r for r in range(self.s.nodes) if nodes[members[r]].role != "member"]
      free = self.fleet.spares()
      if len(free) < len(need):
        if self.s.respawn_spares and time.time() - rec["t_detect"] < self.s.startup_timeout_s:
          return None  # a replacement node is booting
        raise RunFailed(f"{len(need)} rank(s) failed but only {len(free)} warm spare(s) are left: raise "
                        f"extras.resilience.spares or set respawn_spares=True")
      rec["swaps"] = {}
      for r, spare in zip(need, free):
        old = members[r]
        members[r] = spare
        nodes[spare].role = "member"
        rec["swaps"][r] = (old, spare)
      rec["plan"] = self.choose_tier(set(rec["swaps"]))
      rec["fetch_pending"] = {}
      if rec["plan"]["tier"] == "memory":
        for r in rec["swaps"]:
          sources = [nodes[h].data_addr for h in sorted(self.commits.holders.get(r, ())) if nodes[h].alive]
          spare = members[r]
          self.fleet.send(spare, {"type": "fetch", "rank": r, "version": rec["plan"]["version"], "sources": sources})
          rec["fetch_pending"][spare] = r
      self.events.emit("swap", swaps={r: list(v) for r, v in rec["swaps"].items()}, tier=rec["plan"]["tier"],
                       version=rec["plan"]["version"])
    if rec["fetch_pending"]:
      return None
    rec["t_fetched"] = time.time()
    return rec["plan"]

  def choose_tier(self, swapped: set) -> dict:
    rec, nodes, members = self.current, self.fleet.nodes, self.membership.members
    c = self.commits.committed
    ok = c >= 0 and rec["tier_forced"] is None
    why = "" if ok else ("nothing committed yet" if c < 0 else f"forced ({rec['tier_forced']})")
    if ok:
      for r in range(self.s.nodes):
        if r in swapped:
          live = [h for h in self.commits.holders.get(r, ()) if nodes[h].alive]
          if not live:
            ok, why = False, f"rank {r}: its node and all {self.s.replicas} replica holder(s) are lost"
            break
        elif self.commits.owner.get(r) != members[r]:
          ok, why = False, f"rank {r}: own copy is on a node that no longer holds it"
          break
    if ok:
      plan = {"tier": "memory", "version": c}
    else:
      p = latest_persistent_step(self.workdir)
      plan = {"tier": "persistent", "version": p} if p is not None else {"tier": "init", "version": 0}
    self.events.emit("tier", **plan, why=why or "every rank has a live in-memory copy")
    return plan

  def on_fetched(self, name: str, msg: dict):
    rec = self.current
    if rec is None or name not in rec.get("fetch_pending", {}):
      return
    rec.setdefault("fetch_s", []).append(msg["t"] - msg["t0"])
    r = rec["fetch_pending"].pop(name)
    if msg["ok"]:
      self.commits.owner[r] = name  # the spare now holds rank r's committed copy in its own store
    self.events.emit("fetched", node=name, ok=msg["ok"], rank=msg["rank"], source=msg.get("source"),
                     mb=round(msg.get("bytes", 0) / 1e6, 3), s=round(msg["t"] - msg["t0"], 4))
    if not msg["ok"]:
      rec["fetch_pending"] = {}
      p = latest_persistent_step(self.workdir)
      rec["plan"] = {"tier": "persistent", "version": p} if p is not None else {"tier": "init", "version": 0}
      self.events.emit("tier", **rec["plan"], why="replica fetch failed (checksum or all sources gone)")

  def on_timing(self, rank: int, msg: dict):
    self.current.setdefault("timings", {})[rank] = msg

  def on_first_step(self, rank: int, t: float):
    """A rank of the new generation ran its first step (or finished): the recovery ends when all have."""
    self.current.setdefault("first_step_t", {})[rank] = t
    if len(self.current["first_step_t"]) == self.s.nodes:
      self.finish()

  def finish(self):
    rec, self.current = self.current, None
    t = rec.get("timings", {})
    first = max(rec["first_step_t"].values())
    restore_worker = max((x["t_restored"] - x["t_built"]) for x in t.values()) if t else 0.0
    init = max((x["t_init"] - x["t_start"]) for x in t.values()) if t else 0.0
    build = max((x["t_built"] - x["t_init"]) for x in t.values()) if t else 0.0
    compile_ = max((x["t_compiled"] - x["t_restored"]) for x in t.values()) if t else 0.0
    first_step = max(first - x["t_compiled"] for x in t.values()) if t else 0.0
    fetch = max(rec.get("fetch_s", [0.0]))
    total = first - rec["t_fail"]
    detect = rec["t_detect"] - rec["t_fail"]
    restore = fetch + restore_worker
    rebuild = total - detect - restore - compile_ - first_step
    plan = rec.get("plan", {})
    out = {"causes": rec["causes"], "failed_ranks": sorted(rec["failed"]), "swaps": rec.get("swaps", {}),
           "tier": plan.get("tier"), "restored_version": plan.get("version"), "last_step": rec["last_step"],
           "steps_recomputed": max(rec["last_step"] - plan.get("version", 0), 0),
           "recovery_time_s": total,
           "breakdown_s": {"detect": detect, "rebuild": rebuild, "restore": restore, "recompile": compile_,
                           "first_step": first_step},
           "detail_s": {"fence": rec.get("t_fenced", rec["t_detect"]) - rec["t_detect"], "replica_fetch": fetch,
                        "jax_distributed_init": init, "mesh_and_step_build": build,
                        "restore_in_worker": restore_worker},
           "restarts_during_recovery": rec["n_restarts"], "injected": rec.get("injected", [])}
    self.reports.append(out)
    self.events.emit("recovered", **{k: v for k, v in out.items() if k != "swaps"})


def latest_persistent_step(workdir: str) -> Optional[int]:
  """Latest *finalized* orbax step in <workdir>/checkpoints that looks complete (orbax writes tmp dirs, then
  renames; the workers verify its checksum when they restore it)."""
  return ckpt_lib.latest_usable_step(ckpt_lib.checkpoint_dir(workdir))
