"""Controller: membership, commit, failure detection, hot swap (one per job; no jax runtime).

Generation protocol (what restarts and what survives):
* agents and their shared-memory stores survive every failure except their own node's;
* every worker of generation g is fenced (SIGKILL through its agent) on any failure: on CPU/gloo a
  survivor cannot leave a collective whose peer died (resilience/README.md), and a fresh process per
  generation is the design that also holds on GPU clusters without relying on NCCL abort;
* generation g+1 runs on a fresh coordinator port hosted by the new rank 0 (a spare if rank 0
  failed), so it never depends on the failed node; agents hand it to warm standby workers.
Commit: version v is durable once every rank's own copy is stored and r buddies acknowledged it.
Restore tier (automatic, logged): memory (own shared memory; spares pull their rank's replica from
a buddy) if every failed rank has a live replica of the last committed version, else persistent
(orbax, latest step), else init (step 0; deterministic, so still bit-identical, only slower).

Parts (composition; each receives the state it reads or changes, resilience/run_state.py):
* resilience/fleet.py      agent processes and sockets (launch, send, publish, kill, poll, shut down);
* resilience/recovery.py   Recovery: fence, swap spares in, choose the tier, time the breakdown;
* resilience/injection.py  Injector: fires the planned faults, tells a detected failure which fault it was;
* resilience/report.py     summary(): hotswap_summary.json from the run state.
This module keeps the protocol: start-up, generations, message handling, commit, failure detection, stop.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import List, Optional

from framework import checkpoint as ckpt_lib
from framework.stop import Stopped
from resilience import injection, report, wire
from resilience.fleet import Fleet, kill
from resilience.injection import Injector
from resilience.recovery import Recovery, RunFailed
from resilience.run_state import Commits, EventLog, Membership, Progress, Trajectory
from resilience.settings import HotswapSettings, to_dict


class Controller:
  def __init__(self, cfg_dict: dict, total_steps: int, s: HotswapSettings, workdir: str, run_id: str,
               lock_fd: Optional[int] = None):
    self.cfg_dict, self.total, self.s, self.workdir, self.run_id = cfg_dict, total_steps, s, workdir, run_id
    self.fleet = Fleet(s, workdir, run_id, lock_fd)
    faults = injection.plan(s, total_steps)
    self.membership = Membership()
    self.commits = Commits()
    self.progress = Progress()  # replaced at each generation's start
    self.trajectory = Trajectory()
    self.t0 = time.time()
    self.events = EventLog(os.path.join(workdir, "hotswap_events.jsonl"), self.t0, self.membership)
    self.metrics_f = open(os.path.join(workdir, "metrics.jsonl"), "a")  # one line per step (rank 0's loss)
    self.recovery = Recovery(s, workdir, self.fleet, self.membership, self.commits, self.events)
    self.injector = Injector(s, faults, self.fleet, self.membership, self.events)
    self.cache_dir = s.compile_cache_dir or os.path.join(workdir, "jax_cache")
    self.last_commit_pub = 0.0
    self.stop_signal: Optional[int] = None  # SIGINT / SIGTERM to the launcher (on_stop_signal)
    self.stop_forwarded: Optional[float] = None
    self.stopped: dict = {}  # rank -> the step it saved and stopped after

  def buddies(self, rank: int) -> List[int]:
    return [(rank + 1 + j) % self.s.nodes for j in range(self.s.replicas)]

  # -- start -------------------------------------------------------------------------------------------
  def start(self):
    os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)
    for i in range(self.s.nodes):
      self.fleet.launch(f"node{i}")
    for i in range(self.s.spares):
      self.fleet.launch(f"spare{i}")
    nodes = self.fleet.nodes
    deadline = time.time() + self.s.startup_timeout_s
    while not all(n.hello and n.standby_ready for n in nodes.values()):
      if time.time() > deadline:
        bad = [n.name for n in nodes.values() if not (n.hello and n.standby_ready)]
        raise RunFailed(f"agents {bad} did not come up within {self.s.startup_timeout_s}s: see "
                        f"{self.workdir}/logs/*.log")
      self.poll_once(50)
      self.fleet.ping(time.time())
      for n in nodes.values():
        if n.proc.poll() is not None:
          raise RunFailed(f"agent {n.name} exited with rc {n.proc.returncode} at start-up: see "
                          f"{self.workdir}/logs/{n.name}-agent.log")
    self.membership.members = [f"node{i}" for i in range(self.s.nodes)]
    for name in self.membership.members:
      nodes[name].role = "member"
    self.events.emit("agents_ready", nodes=self.membership.members, spares=self.fleet.spares())
    self.start_generation(self.resume_plan())

  def resume_plan(self) -> dict:
    """A rerun in the same workdir continues from its newest persistent checkpoint (verified by the workers on
    restore: a corrupt one is moved aside and the next older one is used, a foreign one stops the run)."""
    step = ckpt_lib.latest_usable_step(ckpt_lib.checkpoint_dir(self.workdir))
    if step is None or step <= 0:
      return {"tier": "init", "version": 0}
    self.events.emit("resume", version=step, source=ckpt_lib.checkpoint_dir(self.workdir))
    return {"tier": "persistent", "version": min(step, self.total)}

  def start_generation(self, plan: dict):
    m, nodes = self.membership, self.fleet.nodes
    m.gen += 1
    coordinator = f"127.0.0.1:{wire.free_port()}"
    self.commits.new_generation(plan)
    self.progress = Progress.starting(plan["version"])
    m.phase = "running"
    for rank, name in enumerate(m.members):
      msg = {"type": "assign", "gen": m.gen, "rank": rank, "n": self.s.nodes, "coordinator": coordinator,
             "restore": dict(plan), "buddies": [nodes[m.members[b]].data_addr for b in self.buddies(rank)],
             "config": self.cfg_dict, "settings": to_dict(self.s), "workdir": self.workdir,
             "controller_pull": self.fleet.pull_addr, "controller_pub": self.fleet.pub_addr, "run_id": self.run_id,
             "compile_cache_dir": self.cache_dir}
      self.fleet.send(name, msg)
    self.events.emit("generation", coordinator=coordinator, members=list(m.members), tier=plan["tier"],
                     version=plan["version"])

  # -- messages ----------------------------------------------------------------------------------------
  def poll_once(self, timeout_ms: int):
    return self.fleet.poll(timeout_ms, self.on_agent, self.on_worker)

  def on_agent(self, name: str, msg: dict):
    node = self.fleet.nodes.get(name)
    if node is None:
      return
    node.last_hb = time.time()
    kind = msg["type"]
    gen = self.membership.gen
    if kind == "hello":
      node.hello, node.data_addr = True, msg["data_addr"]
    elif kind == "standby_ready":
      node.standby_ready = True
    elif kind == "standby_exit":
      node.standby_ready = False
    elif kind == "started":
      node.standby_ready = False
      node.worker_pid = msg["pid"]
      self.injector.on_started(name, self.recovery.current)
    elif kind == "killed":
      self.recovery.on_killed(name)
    elif kind == "fetched":
      self.recovery.on_fetched(name, msg)
    elif kind == "worker_exit":
      self.on_worker_exit(name, msg)
    elif kind == "assign_failed":
      self.events.emit("assign_failed", node=name, why=msg["why"])
      if msg["gen"] == gen:
        self.begin_recovery(set(), "assign_failed", time.time(), force_tier="persistent")
    elif kind == "stored":
      if msg["gen"] == gen:
        self.commits.stored.setdefault(msg["version"], set()).add(msg["rank"])
        self.check_commit(msg["version"])
        self.injector.on_stored(msg)
    elif kind == "ack":
      if msg["gen"] == gen:
        self.commits.acks.setdefault(msg["version"], {}).setdefault(msg["origin"], set()).add(name)
        self.check_commit(msg["version"])

  def on_worker(self, msg: dict):
    kind = msg["type"]
    m, p, rec = self.membership, self.progress, self.recovery
    if msg.get("gen") != m.gen:
      return
    rank = msg["rank"]
    p.worker_hb[rank] = time.time()
    if kind == "step":
      step = msg["step"]
      if self.trajectory.record_step(msg, m.gen):
        self.metrics_f.write(json.dumps({"step": step, "loss": msg["loss"], "gen": m.gen, "run_id": self.run_id,
                                         "t": msg["t"]}) + "\n")
        self.metrics_f.flush()
      if step > p.max_step:
        p.max_step = step
        p.last_progress = time.time()
      if rank not in p.first_steps:
        p.first_steps.add(rank)
        if p.training(self.s.nodes):  # the generation runs: refill warm standbys
          for name, node in self.fleet.nodes.items():
            if node.alive and node.role in ("member", "spare"):
              self.fleet.send(name, {"type": "spawn_standby"})
      if rec.current is not None and m.phase == "running":
        rec.on_first_step(rank, msg["t"])
      self.injector.maybe_inject(step, recovering=rec.current is not None)
    elif kind == "timing":
      if rec.current is not None:
        rec.on_timing(rank, msg)
      elif m.gen == 0:  # start-up of this launch (a rerun's restart cost)
        self.trajectory.start_timings[rank] = msg
    elif kind == "done":
      p.done[rank] = msg
      if rec.current is not None and m.phase == "running":  # recovered at the very end: nothing left to run
        rec.on_first_step(rank, time.time())
    elif kind == "stopped":  # saved its checkpoint at the agreed step (advance_stop)
      self.stopped[rank] = msg["step"]
      p.done[rank] = msg
    elif kind == "restore_failed":
      self.on_restore_failed(msg)
    elif kind == "error":
      self.events.emit("worker_error", rank=rank, node=msg["node"], error=msg["error"], trace=msg.get("trace"))
      # an error with no failure detected within the grace period is a bug, also while a new generation
      # is still starting (its first steps not yet seen); a secondary effect of a crash clears it
      if p.pending_error is None and m.phase == "running":
        p.pending_error = {"t": time.time(), **msg}

  def on_restore_failed(self, msg: dict):
    """A worker could not restore its plan: memory snapshot checksum, or a bad / foreign persistent checkpoint."""
    self.events.emit("restore_failed", rank=msg["rank"], node=msg["node"], why=msg["why"], kind=msg.get("kind"),
                     step=msg.get("step"))
    if self.membership.phase != "running":
      return  # this generation is already being fenced
    if msg.get("kind") == "foreign":
      raise RunFailed(msg["why"])
    cause = "in-memory restore failed its checksum"
    if msg.get("tier") == "persistent":
      cause = f"persistent checkpoint step {msg.get('step')} unusable"
    self.begin_recovery(set(), cause, time.time(), force_tier="persistent")
    if msg.get("tier") == "persistent":  # moved aside once the generation is fenced (Recovery.advance)
      self.recovery.quarantine_later(msg.get("step"), msg["why"])

  def check_commit(self, v: int):
    m = self.membership
    if not self.commits.try_commit(v, m.members, self.s.replicas):
      return
    self.fleet.publish({"type": "commit", "gen": m.gen, "version": v})
    for node in self.fleet.nodes.values():  # replicas now live on current members: release retired nodes
      if node.role == "retired" and node.alive and not node.released:
        node.released = True
        self.fleet.send(node.name, {"type": "exit"})

  # -- failure detection ----------------------------------------------------------------------------
  def on_worker_exit(self, name: str, msg: dict):
    node = self.fleet.nodes[name]
    node.worker_pid = None
    if msg["gen"] != self.membership.gen or node.role != "member":
      return
    rank = self.membership.rank_of(name)
    if msg["rc"] == 0 and rank in self.progress.done:
      return
    if self.membership.phase == "fencing":
      return  # expected: we are killing this generation
    self.failure({rank}, f"worker exit rc={msg['rc']}", msg["t"])

  def tick(self):
    now = time.time()
    m = self.membership
    for node in list(self.fleet.nodes.values()):
      if not node.alive:
        continue
      dead = node.proc.poll() is not None or now - node.last_hb > max(4 * self.s.heartbeat_timeout_s, 2.0)
      if dead:
        node.alive = False
        node.standby_ready = False
        self.events.emit("agent_lost", node=node.name, role=node.role, rc=node.proc.returncode)
        if node.role == "member":
          self.failure({m.rank_of(node.name)}, "node lost", now)
        elif node.role == "spare":
          node.role = "retired"
          self.fleet.replenish()
    if m.phase == "running" and self.detect_stall(now):
      return
    self.fleet.ping(now)
    if m.phase == "running" and now - self.last_commit_pub > self.s.heartbeat_s and self.commits.committed >= 0:
      # re-publish: a subscriber that joined after the commit went out (zmq slow joiner) must not wait forever
      self.last_commit_pub = now
      self.fleet.publish({"type": "commit", "gen": m.gen, "version": self.commits.committed})
    if m.phase == "fencing":
      plan = self.recovery.advance()
      if plan is not None:
        self.start_generation(plan)

  def detect_stall(self, now: float) -> bool:
    """Hangs, a generation that does not start, no progress; True when it found one (recovery begun). A worker
    error that no failure explains within the grace period is a bug: RunFailed."""
    p, s = self.progress, self.s
    for rank in range(s.nodes):
      last = p.worker_hb.get(rank)
      if rank in p.done:
        continue
      if last is None or not p.training(s.nodes):
        # before the first step (init, restore, compile) a busy host may starve heartbeats: use the
        # start-up limit; a worker that dies meanwhile is still seen at once through its exit
        if now - p.started_at > s.startup_timeout_s:
          self.failure({rank} if last is None else set(), "generation did not start in time", now)
          return True
      elif now - last > s.heartbeat_timeout_s:
        self.failure({rank}, "heartbeat timeout (hang)", last)
        return True
    if p.training(s.nodes) and now - p.last_progress > s.step_timeout_s and len(p.done) < s.nodes:
      self.failure(set(), "step timeout (no progress)", p.last_progress)
      return True
    pe = p.pending_error
    if pe is not None and pe["gen"] == self.membership.gen and now - pe["t"] > 2 * s.heartbeat_timeout_s + 1:
      raise RunFailed(f"worker rank {pe['rank']} ({pe['node']}) raised and no node failed: this is a bug, "
                      f"not a fault: {pe['error']}\n{pe.get('trace', '')}")
    return False

  def failure(self, ranks: set, cause: str, t_fail: float, force_tier: Optional[str] = None):
    ranks = {r for r in ranks if r is not None}
    t_inj, injected = self.injector.take_detected()
    self.begin_recovery(ranks, cause, t_inj or t_fail, force_tier=force_tier, injected=injected)

  def begin_recovery(self, ranks: set, cause: str, t_fail: float, force_tier: Optional[str] = None,
                     injected=()):
    self.progress.pending_error = None
    self.recovery.begin(ranks, cause, t_fail, self.trajectory.max_step, force_tier=force_tier, injected=injected)

  # -- main loop -------------------------------------------------------------------------------------------
  def run(self) -> dict:
    deadline = self.t0 + self.s.wall_timeout_s
    self.start()
    while len(self.progress.done) < self.s.nodes or self.recovery.current is not None:
      if time.time() > deadline:
        raise RunFailed(f"hot-swap run exceeded wall_timeout_s={self.s.wall_timeout_s}; events in "
                        f"{self.workdir}/hotswap_events.jsonl")
      self.poll_once(10)
      if self.stop_signal is not None:
        self.advance_stop()
      self.tick()
    if self.stopped:
      self.finish_stop()
    self.membership.phase = "done"
    self.events.emit("finished", steps=self.total)
    return report.summary(self.s, self.total, self.workdir, self.membership, self.commits, self.trajectory,
                          self.progress.done, self.recovery.reports, self.injector.faults, self.events)

  # -- stop on a signal -------------------------------------------------------------------------------------
  def on_stop_signal(self, signum, _frame):
    """SIGINT / SIGTERM to the launcher: stop with a checkpoint (advance_stop); a second one exits at once."""
    name = signal.Signals(signum).name
    if self.stop_signal is not None:
      print(f"second {name}: exiting at once without saving; the last complete checkpoint (step "
            f"{ckpt_lib.latest_usable_step(ckpt_lib.checkpoint_dir(self.workdir))}) is intact", file=sys.stderr,
            flush=True)
      raise SystemExit(128 + signum)  # unwinds through run_hotswap's `finally`: agents, shared memory
    self.stop_signal = signum
    print(f"{name} received: the workers save a checkpoint at the next step they all reach (send it again to "
          f"exit at once without saving)", file=sys.stderr, flush=True)

  def advance_stop(self):
    """Forwards the stop to every worker as SIGTERM (jax's preemption sync point picks the step they all save
    at); a job that is starting or recovering has no step to save and stops at once."""
    if self.stop_forwarded is None:
      training = self.membership.phase == "running" and self.recovery.current is None and \
          self.progress.training(self.s.nodes)
      if not training:
        self.stop_now("the job was starting or recovering, so no worker could save")
      self.stop_forwarded = time.time()
      self.events.emit("stop_forwarded", signal=signal.Signals(self.stop_signal).name)
      for name in self.membership.members:
        kill(self.fleet.nodes[name].worker_pid, signal.SIGTERM)
    elif self.membership.phase != "running" or time.time() - self.stop_forwarded > self.s.step_timeout_s + 60:
      self.stop_now("a worker failed or did not save in time")

  def stop_now(self, why: str):
    step = ckpt_lib.latest_usable_step(ckpt_lib.checkpoint_dir(self.workdir)) or 0
    self.events.emit("stopped", saved=False, why=why)
    raise Stopped(self.stop_signal, step, None, note=f" ({why}; the rerun resumes from the last complete "
                                                     f"checkpoint, step {step})")

  def finish_stop(self):
    steps = set(self.stopped.values())
    if len(steps) != 1 or len(self.stopped) != self.s.nodes:
      raise RunFailed(f"workers stopped at different steps {self.stopped}: this is a bug; the rerun resumes from "
                      f"the last complete checkpoint")
    step = steps.pop()
    self.events.emit("stopped", saved=True, step=step)
    raise Stopped(self.stop_signal, step, os.path.join(ckpt_lib.checkpoint_dir(self.workdir), str(step)))

  def close(self):
    self.fleet.stop_agents()
    self.events.close()
    self.metrics_f.close()
    self.fleet.close_sockets()
