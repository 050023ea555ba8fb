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
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

import zmq

from resilience import injection, wire
from framework import checkpoint as ckpt_lib
from framework.stop import Stopped
from resilience.deathsig import term_with_parent
from resilience.injection import InjectorMixin
from resilience.recovery import RecoveryMixin, RunFailed
from resilience.report import ReportMixin
from resilience.settings import HotswapSettings, to_dict

log = logging.getLogger("prismllm.resilience")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


class Controller(RecoveryMixin, InjectorMixin, ReportMixin):
  def __init__(self, cfg_dict: dict, total_steps: int, s: HotswapSettings, workdir: str, run_id: str,
               lock_fd: Optional[int] = None):
    self.cfg_dict, self.total, self.s, self.workdir, self.run_id = cfg_dict, total_steps, s, workdir, run_id
    self.lock_fd = lock_fd  # the workdir lock: agents inherit it, so it is free only once all of them are gone
    self.ctx = zmq.Context()
    self.router = wire.new_socket(self.ctx, zmq.ROUTER)
    self.router_addr = wire.bind_random(self.router)
    self.pull = wire.new_socket(self.ctx, zmq.PULL)
    self.pull_addr = wire.bind_random(self.pull)
    self.pub = wire.new_socket(self.ctx, zmq.PUB)
    self.pub_addr = wire.bind_random(self.pub)
    self.nodes: Dict[str, Node] = {}
    self.members: List[str] = []
    self.gen = -1
    self.state = "starting"  # starting | running | fencing | done
    self.committed = -1
    self.committed_holders: Dict[int, set] = {}
    self.committed_owner: Dict[int, str] = {}
    self.gen_first_steps: set = set()
    self.stored: Dict[int, set] = {}
    self.acks: Dict[int, Dict[int, set]] = {}
    self.losses: Dict[int, float] = {}
    self.loss_mismatch: List[int] = []
    self.loss_gen: Dict[int, int] = {}  # generation that first reported each step's loss
    self.recompute_checks = 0  # reports of a step an earlier generation had computed, compared bit for bit
    self.max_step = 0
    self.gen_max_step = 0
    self.worker_hb: Dict[int, float] = {}
    self.gen_started_at = 0.0
    self.last_progress = time.time()
    self.step_times: List[dict] = []
    self.done: Dict[int, dict] = {}
    self.events: List[dict] = []
    self.recoveries: List[dict] = []
    self.rec: Optional[dict] = None
    self.pending_error: Optional[dict] = None
    self.faults = injection.plan(s, total_steps)
    self.spare_counter = 0
    self.cache_dir = s.compile_cache_dir or os.path.join(workdir, "jax_cache")
    self.start_timings: Dict[int, dict] = {}
    self.stop_signal: Optional[int] = None  # SIGINT / SIGTERM to the launcher (on_stop_signal)
    self.stop_forwarded: Optional[float] = None
    self.stopped: Dict[int, int] = {}  # rank -> the step it saved and stopped after
    self.events_f = open(os.path.join(workdir, "hotswap_events.jsonl"), "a")
    self.metrics_f = open(os.path.join(workdir, "metrics.jsonl"), "a")  # one line per step (rank 0's loss)
    self.t0 = time.time()

  # -- bookkeeping -----------------------------------------------------------------------------------
  def event(self, what: str, **kw):
    rec = {"t": round(time.time() - self.t0, 4), "event": what, "gen": self.gen, **kw}
    self.events.append(rec)
    self.events_f.write(json.dumps(rec, default=str) + "\n")
    self.events_f.flush()
    log.info("%s %s", what, {k: v for k, v in kw.items() if k != "trace"})

  def launch_node(self, name: str) -> Node:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    logf = open(os.path.join(self.workdir, "logs", f"{name}-agent.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "resilience.agent", "--name", name, "--controller", self.router_addr,
         "--run-id", self.run_id, "--workdir", self.workdir, "--heartbeat-s", str(self.s.heartbeat_s),
         "--chunk-mb", str(self.s.chunk_mb), "--controller-timeout-s", str(self.s.controller_timeout_s)],
        env=env, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, preexec_fn=term_with_parent,
        pass_fds=() if self.lock_fd is None else (self.lock_fd,))
    logf.close()
    node = self.nodes[name] = Node(name, proc)
    return node

  def send(self, name: str, msg: dict):
    wire.send(self.router, msg, ident=name.encode())

  def ping_agents(self, now: float):
    """Agents clean up and exit when the controller is silent for controller_timeout_s (it died)."""
    if now - getattr(self, "last_ping", 0.0) > self.s.heartbeat_s:
      self.last_ping = now
      for node in self.nodes.values():
        if node.alive:
          self.send(node.name, {"type": "ping"})

  def spares(self) -> List[str]:
    return [n.name for n in self.nodes.values() if n.role == "spare" and n.alive and n.standby_ready]

  def rank_of(self, name: str) -> Optional[int]:
    return self.members.index(name) if name in self.members else None

  def buddies(self, rank: int) -> List[int]:
    return [(rank + 1 + j) % self.s.nodes for j in range(self.s.replicas)]

  # -- start -------------------------------------------------------------------------------------------
  def start(self):
    os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)
    for i in range(self.s.nodes):
      self.launch_node(f"node{i}")
    for i in range(self.s.spares):
      self.launch_node(f"spare{i}")
    deadline = time.time() + self.s.startup_timeout_s
    while not all(n.hello and n.standby_ready for n in self.nodes.values()):
      if time.time() > deadline:
        bad = [n.name for n in self.nodes.values() if not (n.hello and n.standby_ready)]
        raise RunFailed(f"agents {bad} did not come up within {self.s.startup_timeout_s}s: see "
                        f"{self.workdir}/logs/*.log")
      self.poll_once(50)
      self.ping_agents(time.time())
      for n in self.nodes.values():
        if n.proc.poll() is not None:
          raise RunFailed(f"agent {n.name} exited with rc {n.proc.returncode} at start-up: see "
                          f"{self.workdir}/logs/{n.name}-agent.log")
    self.members = [f"node{i}" for i in range(self.s.nodes)]
    for name in self.members:
      self.nodes[name].role = "member"
    self.event("agents_ready", nodes=self.members, spares=self.spares())
    self.start_generation(self.resume_plan())

  def resume_plan(self) -> dict:
    """A rerun in the same workdir continues from its newest persistent checkpoint (verified by the workers on
    restore: a corrupt one is moved aside and the next older one is used, a foreign one stops the run)."""
    step = ckpt_lib.latest_usable_step(ckpt_lib.checkpoint_dir(self.workdir))
    if step is None or step <= 0:
      return {"tier": "init", "version": 0}
    self.event("resume", version=step, source=ckpt_lib.checkpoint_dir(self.workdir))
    return {"tier": "persistent", "version": min(step, self.total)}

  def start_generation(self, plan: dict):
    self.gen += 1
    coordinator = f"127.0.0.1:{wire.free_port()}"
    if plan["tier"] != "memory":  # restored from disk / step 0: versions restart there, memory copies are void
      self.committed = plan["version"] if plan["tier"] == "persistent" else -1
      self.committed_holders, self.committed_owner = {}, {}
    # acks and stores of uncommitted versions belong to the dead generation
    self.stored, self.acks = {}, {}
    self.worker_hb = {}
    self.gen_started_at = self.last_progress = time.time()
    self.gen_max_step = plan["version"]
    self.done = {}
    self.gen_first_steps = set()
    self.pending_error = None
    self.state = "running"
    for rank, name in enumerate(self.members):
      msg = {"type": "assign", "gen": self.gen, "rank": rank, "n": self.s.nodes, "coordinator": coordinator,
             "restore": dict(plan), "buddies": [self.nodes[self.members[b]].data_addr for b in self.buddies(rank)],
             "config": self.cfg_dict, "settings": to_dict(self.s), "workdir": self.workdir,
             "controller_pull": self.pull_addr, "controller_pub": self.pub_addr, "run_id": self.run_id,
             "compile_cache_dir": self.cache_dir}
      self.send(name, msg)
    self.event("generation", coordinator=coordinator, members=list(self.members), tier=plan["tier"],
               version=plan["version"])

  # -- messages ----------------------------------------------------------------------------------------
  def poll_once(self, timeout_ms: int):
    poller = zmq.Poller()
    poller.register(self.router, zmq.POLLIN)
    poller.register(self.pull, zmq.POLLIN)
    socks = dict(poller.poll(timeout_ms))
    while self.router.poll(0):
      ident, msg, _ = wire.recv(self.router, router=True)
      self.on_agent(ident.decode(), msg)
    while self.pull.poll(0):
      _, msg, _ = wire.recv(self.pull)
      self.on_worker(msg)
    return socks

  def on_agent(self, name: str, msg: dict):
    node = self.nodes.get(name)
    if node is None:
      return
    node.last_hb = time.time()
    kind = msg["type"]
    if kind == "hello":
      node.hello, node.data_addr = True, msg["data_addr"]
    elif kind == "standby_ready":
      node.standby_ready = True
    elif kind == "standby_exit":
      node.standby_ready = False
    elif kind == "started":
      node.standby_ready = False
      node.worker_pid = msg["pid"]
      self.maybe_inject_recovery_stage(name)
    elif kind == "killed":
      if self.rec is not None:
        self.rec["kills_pending"].discard(name)
    elif kind == "fetched":
      self.on_fetched(name, msg)
    elif kind == "worker_exit":
      self.on_worker_exit(name, msg)
    elif kind == "assign_failed":
      self.event("assign_failed", node=name, why=msg["why"])
      if msg["gen"] == self.gen:
        self.begin_recovery(set(), "assign_failed", time.time(), force_tier="persistent")
    elif kind == "stored":
      if msg["gen"] == self.gen:
        self.stored.setdefault(msg["version"], set()).add(msg["rank"])
        self.check_commit(msg["version"])
        self.maybe_inject_replication_time(msg)
    elif kind == "ack":
      if msg["gen"] == self.gen:
        self.acks.setdefault(msg["version"], {}).setdefault(msg["origin"], set()).add(name)
        self.check_commit(msg["version"])

  def on_worker(self, msg: dict):
    kind = msg["type"]
    if msg.get("gen") != self.gen:
      return
    rank = msg["rank"]
    self.worker_hb[rank] = time.time()
    if kind == "step":
      step = msg["step"]
      if step in self.losses:
        if self.losses[step] != msg["loss"]:  # ranks disagree, or a recomputed step differs
          self.loss_mismatch.append(step)
        if self.loss_gen[step] < self.gen:
          self.recompute_checks += 1
      if rank == 0:
        self.losses[step] = msg["loss"]
        self.loss_gen[step] = self.gen
        self.metrics_f.write(json.dumps({"step": step, "loss": msg["loss"], "gen": self.gen, "run_id": self.run_id,
                                         "t": msg["t"]}) + "\n")
        self.metrics_f.flush()
        self.step_times.append({"gen": self.gen, "step": step, "dt": msg["dt"], "on": msg["on"],
                                "transition": msg["transition"], "first": msg["first"],
                                "after_save": msg.get("after_save", False), "t": msg["t"]})
      if step > self.gen_max_step:
        self.gen_max_step = step
        self.last_progress = time.time()
      self.max_step = max(self.max_step, step)
      self.t_first_step = getattr(self, "t_first_step", None) or time.time()
      self.t_last_step = time.time()
      if rank not in self.gen_first_steps:
        self.gen_first_steps.add(rank)
        if len(self.gen_first_steps) == self.s.nodes:  # the generation runs: refill warm standbys
          for name, node in self.nodes.items():
            if node.alive and node.role in ("member", "spare"):
              self.send(name, {"type": "spawn_standby"})
      if self.rec is not None and self.state == "running":
        self.rec.setdefault("first_step_t", {})[rank] = msg["t"]
        if len(self.rec["first_step_t"]) == self.s.nodes:
          self.finish_recovery()
      self.maybe_inject(step)
    elif kind == "timing":
      if self.rec is not None:
        self.rec.setdefault("timings", {})[rank] = msg
      elif self.gen == 0:  # start-up of this launch (a rerun's restart cost)
        self.start_timings[rank] = msg
    elif kind == "done":
      self.done[rank] = msg
      if self.rec is not None and self.state == "running":  # recovered at the very end: nothing left to run
        self.rec.setdefault("first_step_t", {})[rank] = time.time()
        if len(self.rec["first_step_t"]) == self.s.nodes:
          self.finish_recovery()
    elif kind == "stopped":  # saved its checkpoint at the agreed step (advance_stop)
      self.stopped[rank] = msg["step"]
      self.done[rank] = msg
    elif kind == "restore_failed":
      self.on_restore_failed(msg)
    elif kind == "error":
      self.event("worker_error", rank=rank, node=msg["node"], error=msg["error"], trace=msg.get("trace"))
      # an error with no failure detected within the grace period is a bug, also while a new generation
      # is still starting (its first steps not yet seen); a secondary effect of a crash clears it
      if self.pending_error is None and self.state == "running":
        self.pending_error = {"t": time.time(), **msg}

  def on_restore_failed(self, msg: dict):
    """A worker could not restore its plan: memory snapshot checksum, or a bad / foreign persistent checkpoint."""
    self.event("restore_failed", rank=msg["rank"], node=msg["node"], why=msg["why"], kind=msg.get("kind"),
               step=msg.get("step"))
    if self.state != "running":
      return  # this generation is already being fenced
    if msg.get("kind") == "foreign":
      raise RunFailed(msg["why"])
    cause = "in-memory restore failed its checksum"
    if msg.get("tier") == "persistent":
      cause = f"persistent checkpoint step {msg.get('step')} unusable"
    self.begin_recovery(set(), cause, time.time(), force_tier="persistent")
    if msg.get("tier") == "persistent":  # moved aside once the generation is fenced (advance_recovery)
      self.rec.setdefault("quarantine", []).append((msg.get("step"), msg["why"]))

  def check_commit(self, v: int):
    if v <= self.committed or len(self.stored.get(v, ())) < self.s.nodes:
      return
    acks = self.acks.get(v, {})
    if all(len(acks.get(k, ())) >= self.s.replicas for k in range(self.s.nodes)):
      self.committed = v
      self.committed_holders = {k: set(acks[k]) for k in range(self.s.nodes)}
      self.committed_owner = {k: self.members[k] for k in range(self.s.nodes)}
      wire.send(self.pub, {"type": "commit", "gen": self.gen, "version": v})
      for node in self.nodes.values():  # replicas now live on current members: release retired nodes
        if node.role == "retired" and node.alive and not getattr(node, "released", False):
          node.released = True
          self.send(node.name, {"type": "exit"})
      for old in [x for x in self.stored if x < v]:
        self.stored.pop(old, None)
        self.acks.pop(old, None)

  # -- failure detection ----------------------------------------------------------------------------
  def on_worker_exit(self, name: str, msg: dict):
    node = self.nodes[name]
    node.worker_pid = None
    if msg["gen"] != self.gen or node.role != "member":
      return
    rank = self.rank_of(name)
    if msg["rc"] == 0 and rank in self.done:
      return
    if self.state == "fencing":
      return  # expected: we are killing this generation
    self.failure({rank}, f"worker exit rc={msg['rc']}", msg["t"])

  def tick(self):
    now = time.time()
    for node in list(self.nodes.values()):
      if not node.alive:
        continue
      dead = node.proc.poll() is not None or now - node.last_hb > max(4 * self.s.heartbeat_timeout_s, 2.0)
      if dead:
        node.alive = False
        node.standby_ready = False
        self.event("agent_lost", node=node.name, role=node.role, rc=node.proc.returncode)
        if node.role == "member":
          self.failure({self.rank_of(node.name)}, "node lost", now)
        elif node.role == "spare":
          node.role = "retired"
          self.replenish()
    if self.state == "running":
      for rank in range(self.s.nodes):
        last = self.worker_hb.get(rank)
        if rank in self.done:
          continue
        training = len(self.gen_first_steps) == self.s.nodes
        if last is None or not training:
          # before the first step (init, restore, compile) a busy host may starve heartbeats: use the
          # start-up limit; a worker that dies meanwhile is still seen at once through its exit
          if now - self.gen_started_at > self.s.startup_timeout_s:
            self.failure({rank} if last is None else set(), "generation did not start in time", now)
            return
        elif now - last > self.s.heartbeat_timeout_s:
          self.failure({rank}, "heartbeat timeout (hang)", last)
          return
      if len(self.gen_first_steps) == self.s.nodes and now - self.last_progress > self.s.step_timeout_s \
          and len(self.done) < self.s.nodes:
        self.failure(set(), "step timeout (no progress)", self.last_progress)
        return
      if self.pending_error is not None and self.pending_error["gen"] == self.gen and \
         now - self.pending_error["t"] > 2 * self.s.heartbeat_timeout_s + 1:
        pe = self.pending_error
        raise RunFailed(f"worker rank {pe['rank']} ({pe['node']}) raised and no node failed: this is a bug, "
                        f"not a fault: {pe['error']}\n{pe.get('trace', '')}")
    self.ping_agents(now)
    if self.state == "running" and now - getattr(self, "last_commit_pub", 0.0) > self.s.heartbeat_s and \
       self.committed >= 0:
      # re-publish: a subscriber that joined after the commit went out (zmq slow joiner) must not wait forever
      self.last_commit_pub = now
      wire.send(self.pub, {"type": "commit", "gen": self.gen, "version": self.committed})
    if self.state == "fencing":
      self.advance_recovery()

  def failure(self, ranks: set, cause: str, t_fail: float, force_tier: Optional[str] = None):
    ranks = {r for r in ranks if r is not None}
    injected = [f for f in self.faults if f.fired and not f.__dict__.get("detected")]
    t_inj = None
    for f in injected:
      f.__dict__["detected"] = True
      t_inj = f.__dict__.get("t_fail", t_inj)
    self.begin_recovery(ranks, cause, t_inj or t_fail, force_tier=force_tier)
    self.rec.setdefault("injected", []).extend(f.kind for f in injected)

  # -- main loop -------------------------------------------------------------------------------------------
  def run(self) -> dict:
    deadline = self.t0 + self.s.wall_timeout_s
    self.start()
    while len(self.done) < self.s.nodes or self.rec is not None:
      if time.time() > deadline:
        raise RunFailed(f"hot-swap run exceeded wall_timeout_s={self.s.wall_timeout_s}; events in "
                        f"{self.workdir}/hotswap_events.jsonl")
      self.poll_once(10)
      if self.stop_signal is not None:
        self.advance_stop()
      self.tick()
    if self.stopped:
      self.finish_stop()
    self.state = "done"
    self.event("finished", steps=self.total)
    return self.summary()

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
      training = self.state == "running" and self.rec is None and len(self.gen_first_steps) == self.s.nodes
      if not training:
        self.stop_now("the job was starting or recovering, so no worker could save")
      self.stop_forwarded = time.time()
      self.event("stop_forwarded", signal=signal.Signals(self.stop_signal).name)
      for name in self.members:
        self._kill(self.nodes[name].worker_pid, signal.SIGTERM)
    elif self.state != "running" or time.time() - self.stop_forwarded > self.s.step_timeout_s + 60:
      self.stop_now("a worker failed or did not save in time")

  def stop_now(self, why: str):
    step = ckpt_lib.latest_usable_step(ckpt_lib.checkpoint_dir(self.workdir)) or 0
    self.event("stopped", saved=False, why=why)
    raise Stopped(self.stop_signal, step, None, note=f" ({why}; the rerun resumes from the last complete "
                                                     f"checkpoint, step {step})")

  def finish_stop(self):
    steps = set(self.stopped.values())
    if len(steps) != 1 or len(self.stopped) != self.s.nodes:
      raise RunFailed(f"workers stopped at different steps {self.stopped}: this is a bug; the rerun resumes from "
                      f"the last complete checkpoint")
    step = steps.pop()
    self.event("stopped", saved=True, step=step)
    raise Stopped(self.stop_signal, step, os.path.join(ckpt_lib.checkpoint_dir(self.workdir), str(step)))

  def close(self):
    for node in self.nodes.values():
      if node.alive and node.proc.poll() is None:
        try:
          self.send(node.name, {"type": "exit"})
        except zmq.ZMQError:
          pass
    end = time.time() + 3
    for node in self.nodes.values():
      try:
        node.proc.wait(timeout=max(end - time.time(), 0.05))
      except subprocess.TimeoutExpired:
        pass
      if node.proc.poll() is None:
        node.proc.kill()
        node.proc.wait()
      self._kill(node.worker_pid)
    self.events_f.close()
    self.metrics_f.close()
    self.router.close()
    self.pull.close()
    self.pub.close()
    self.ctx.term()

