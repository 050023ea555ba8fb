"""Recovery half of the controller: fence, swap spares in, choose the restore tier, time the breakdown.

Mixed into :class:`resilience.controller.Controller` (it uses its members, nodes and sockets).
"""
from __future__ import annotations

import time
from typing import Optional

from framework import checkpoint as ckpt_lib


class RunFailed(RuntimeError):
  """The job cannot continue (no spare left, a bug, a timeout); the message says what to change."""


class RecoveryMixin:
  def begin_recovery(self, ranks: set, cause: str, t_fail: float, force_tier: Optional[str] = None):
    now = time.time()
    self.pending_error = None
    if self.rec is None:
      self.rec = {"t_fail": t_fail, "t_detect": now, "failed": set(), "causes": [], "last_step": self.max_step,
                  "tier_forced": None, "n_restarts": 0}
      self.event("failure_detected", ranks=sorted(ranks), cause=cause, detect_s=round(now - t_fail, 4))
    else:
      self.rec["n_restarts"] += 1
      self.event("failure_during_recovery", ranks=sorted(ranks), cause=cause)
    rec = self.rec
    rec["failed"] |= set(ranks)
    rec["causes"].append(cause)
    if force_tier:
      rec["tier_forced"] = force_tier
    self.state = "fencing"
    for r in ranks:  # retire failed nodes (a crashed worker may mean bad hardware: never reuse it here)
      node = self.nodes[self.members[r]]
      if node.role == "member":
        # a retired node whose agent lives keeps serving the replicas it holds until the new generation
        # commits (released in check_commit), so a second failure meanwhile can still use them
        node.role = "retired"
        self.replenish()
    rec["kills_pending"] = set()
    for name in self.members:  # fence: every worker of this generation, failed node's included
      node = self.nodes[name]
      if node.alive:
        self.send(name, {"type": "kill_worker", "gen": self.gen})
        rec["kills_pending"].add(name)
    rec.pop("fetch_pending", None)
    rec.pop("plan", None)
    rec.pop("first_step_t", None)
    rec.pop("timings", None)

  def replenish(self):
    if self.s.respawn_spares:
      self.spare_counter += 1
      self.launch_node(f"repl{self.spare_counter}")

  def advance_recovery(self):
    rec = self.rec
    if any(self.nodes[n].alive for n in rec["kills_pending"]):
      return
    rec.setdefault("t_fenced", time.time())
    for step, why in rec.pop("quarantine", []):  # a bad persistent step: set aside (kept), then the next older
      moved = ckpt_lib.quarantine(ckpt_lib.checkpoint_dir(self.workdir), step, why)
      self.event("checkpoint_quarantined", step=step, why=why, moved_to=moved)
    if "plan" not in rec:
      # assign spares to every failed rank whose member is retired
      need = [r for r in range(self.s.nodes) if self.nodes[self.members[r]].role != "member"]
      free = self.spares()
      if len(free) < len(need):
        if self.s.respawn_spares and time.time() - rec["t_detect"] < self.s.startup_timeout_s:
          return  # a replacement node is booting
        raise RunFailed(f"{len(need)} rank(s) failed but only {len(free)} warm spare(s) are left: raise "
                        f"extras.resilience.spares or set respawn_spares=True")
      rec["swaps"] = {}
      for r, spare in zip(need, free):
        old = self.members[r]
        self.members[r] = spare
        self.nodes[spare].role = "member"
        rec["swaps"][r] = (old, spare)
      rec["plan"] = self.choose_tier(set(rec["swaps"]))
      rec["fetch_pending"] = {}
      if rec["plan"]["tier"] == "memory":
        for r in rec["swaps"]:
          sources = [self.nodes[h].data_addr for h in sorted(self.committed_holders.get(r, ()))
                     if self.nodes[h].alive]
          spare = self.members[r]
          self.send(spare, {"type": "fetch", "rank": r, "version": rec["plan"]["version"], "sources": sources})
          rec["fetch_pending"][spare] = r
      self.event("swap", swaps={r: list(v) for r, v in rec["swaps"].items()}, tier=rec["plan"]["tier"],
                 version=rec["plan"]["version"])
    if rec["fetch_pending"]:
      return
    rec["t_fetched"] = time.time()
    self.start_generation(rec["plan"])

  def choose_tier(self, swapped: set) -> dict:
    rec = self.rec
    c = self.committed
    ok = c >= 0 and rec["tier_forced"] is None
    why = "" if ok else ("nothing committed yet" if c < 0 else f"forced ({rec['tier_forced']})")
    if ok:
      for r in range(self.s.nodes):
        if r in swapped:
          live = [h for h in self.committed_holders.get(r, ()) if self.nodes[h].alive]
          if not live:
            ok, why = False, f"rank {r}: its node and all {self.s.replicas} replica holder(s) are lost"
            break
        elif self.committed_owner.get(r) != self.members[r]:
          ok, why = False, f"rank {r}: own copy is on a node that no longer holds it"
          break
    if ok:
      plan = {"tier": "memory", "version": c}
    else:
      p = latest_persistent_step(self.workdir)
      plan = {"tier": "persistent", "version": p} if p is not None else {"tier": "init", "version": 0}
    self.event("tier", **plan, why=why or "every rank has a live in-memory copy")
    return plan

  def on_fetched(self, name: str, msg: dict):
    rec = self.rec
    if rec is None or name not in rec.get("fetch_pending", {}):
      return
    rec.setdefault("fetch_s", []).append(msg["t"] - msg["t0"])
    r = rec["fetch_pending"].pop(name)
    if msg["ok"]:
      self.committed_owner[r] = name  # the spare now holds rank r's committed copy in its own store
    self.event("fetched", node=name, ok=msg["ok"], rank=msg["rank"], source=msg.get("source"),
               mb=round(msg.get("bytes", 0) / 1e6, 3), s=round(msg["t"] - msg["t0"], 4))
    if not msg["ok"]:
      rec["fetch_pending"] = {}
      p = latest_persistent_step(self.workdir)
      rec["plan"] = {"tier": "persistent", "version": p} if p is not None else {"tier": "init", "version": 0}
      self.event("tier", **rec["plan"], why="replica fetch failed (checksum or all sources gone)")

  def finish_recovery(self):
    rec, self.rec = self.rec, None
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
    self.recoveries.append(out)
    self.event("recovered", **{k: v for k, v in out.items() if k != "swaps"})


def latest_persistent_step(workdir: str) -> Optional[int]:
  """Latest *finalized* orbax step in <workdir>/checkpoints that looks complete (orbax writes tmp dirs, then
  renames; the workers verify its checksum when they restore it)."""
  return ckpt_lib.latest_usable_step(ckpt_lib.checkpoint_dir(workdir))
