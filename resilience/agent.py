"""Per-node agent: the process SLURM / mpirun / Kubernetes would start once per host.

It holds no jax runtime. It
* owns the node's snapshot store in shared memory (own shard + replicas of its ring predecessors),
  so a crash of the training worker loses nothing;
* replicates each snapshot its worker stores to the r buddy agents (pyzmq DEALER -> ROUTER, zero
  copy out of shared memory) and the buddies acknowledge to the controller;
* serves replicas to a spare that takes over a failed rank;
* keeps a warm standby worker (forked in milliseconds from its zygote, a fork server that imported
  jax and loaded the corpus once), hands it each new generation, reports its exit, and SIGKILLs it
  when the controller fences a generation.

  python -m resilience.agent --name node0 --controller tcp://127.0.0.1:PORT --run-id ID --workdir DIR
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from typing import Dict, Optional

import numpy as np
import zmq

from framework import xla_flags
from resilience import slots as slots_lib
from resilience import wire
from resilience.deathsig import die_with_parent


def worker_env() -> dict:
  env = dict(os.environ)
  # one CPU device per process; single-threaded Eigen: N workers share the host's cores
  env["XLA_FLAGS"] = xla_flags.with_host_device_count(1, "--xla_cpu_multi_thread_eigen=false")
  env.setdefault("JAX_PLATFORMS", "cpu")
  env["TF_CPP_MIN_LOG_LEVEL"] = env.get("TF_CPP_MIN_LOG_LEVEL", "2")
  return env


class Agent:
  def __init__(self, name: str, controller: str, run_id: str, workdir: str):
    self.name, self.run_id, self.workdir = name, run_id, workdir
    self.ctx = zmq.Context()
    self.ctl = wire.new_socket(self.ctx, zmq.DEALER)
    self.ctl.setsockopt(zmq.IDENTITY, name.encode())
    self.ctl.connect(controller)
    self.data = wire.new_socket(self.ctx, zmq.ROUTER)
    self.data_addr = wire.bind_random(self.data)
    self.local = wire.new_socket(self.ctx, zmq.ROUTER)
    self.local_addr = wire.bind_random(self.local)
    self.own: Optional[slots_lib.SlotFile] = None
    self.reps: Dict[int, slots_lib.SlotFile] = {}
    self.peers: Dict[str, zmq.Socket] = {}
    self.standby: Optional[dict] = None  # {'pid', 'ident'}
    self.active: Optional[dict] = None  # {'pid', 'ident', 'gen', 'rank'}
    self.zygote = None
    self.spawning, self.spawning_pid, self.want_standby = False, None, False
    self.exited: Dict[int, int] = {}
    self.assignment: Optional[dict] = None
    self.fault: Optional[dict] = None
    self.pending_assign: Optional[dict] = None
    self.n_spawned = 0
    self.log_dir = os.path.join(workdir, "logs")
    os.makedirs(self.log_dir, exist_ok=True)
    self.chunk = 4 << 20

  # -- processes -------------------------------------------------------------------------------
  def start_zygote(self):
    log = open(os.path.join(self.log_dir, f"{self.name}-zygote.log"), "a")
    self.zygote = subprocess.Popen(
        [sys.executable, "-m", "resilience.worker", "--zygote", "--agent", self.local_addr, "--name", self.name,
         "--workdir", self.workdir],
        env=worker_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, preexec_fn=die_with_parent,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log.close()
    os.set_blocking(self.zygote.stdout.fileno(), False)
    self.zygote_buf, self.zygote_ready, self.spawning = b"", False, False

  def zygote_lines(self):
    try:
      chunk = os.read(self.zygote.stdout.fileno(), 65536)
    except BlockingIOError:
      return []
    self.zygote_buf += chunk
    *lines, self.zygote_buf = self.zygote_buf.split(b"\n")
    return [l.decode().split() for l in lines if l.strip()]

  def on_zygote(self, words):
    if words[0] == "ready":
      self.zygote_ready = True
      if self.want_standby:
        self.spawn_standby()
    elif words[0] == "forked":
      self.spawning_pid = int(words[1])
    elif words[0] == "exit":
      pid, rc = int(words[1]), int(words[2])
      self.exited[pid] = rc
      if self.active is not None and self.active["pid"] == pid:
        wire.send(self.ctl, {"type": "worker_exit", "gen": self.active["gen"], "rank": self.active["rank"],
                             "rc": rc, "t": wire.now()})
        self.active = None
      elif (self.standby or {}).get("pid") == pid or self.spawning_pid == pid:
        wire.send(self.ctl, {"type": "standby_exit", "rc": rc})
        self.standby, self.spawning, self.spawning_pid = None, False, None

  def spawn_standby(self):
    """A warm standby: forked from the zygote (milliseconds), jax imported, corpus loaded."""
    if self.spawning or self.standby is not None:
      return
    if not self.zygote_ready:
      self.want_standby = True
      return
    self.want_standby = False
    self.n_spawned += 1
    self.zygote.stdin.write(f"fork {self.n_spawned}\n".encode())
    self.zygote.stdin.flush()
    self.spawning, self.spawning_pid = True, None

  def kill_active(self):
    if self.active is None:
      return
    pid, self.active = self.active["pid"], None
    try:
      os.kill(pid, signal.SIGKILL)  # also ends a SIGSTOPped or gloo-hung worker
    except ProcessLookupError:
      return
    end = time.time() + 10
    while pid not in self.exited and time.time() < end:  # fenced only once the kernel says it is gone
      if not select.select([self.zygote.stdout], [], [], 0.01)[0]:
        continue
      for words in self.zygote_lines():
        self.on_zygote(words)

  def shutdown(self, unlink=True):
    """Unlinks this node's shared memory first (a mapping stays valid until its last user dies), then ends
    the worker, the standby and the zygote (whose death also ends anything it forked)."""
    for f in [self.own, *self.reps.values()]:
      if f is not None:
        f.close(unlink=unlink)
    for pid in [(self.active or {}).get("pid"), (self.standby or {}).get("pid"), self.spawning_pid]:
      if pid:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    if getattr(self, "zygote", None) is not None:
      self.zygote.kill()
      self.zygote.wait()

  # -- store ---------------------------------------------------------------------------------------
  def _path(self, what: str) -> str:
    return os.path.join(slots_lib.shm_dir(), f"prismllm-{self.run_id}-{self.name}-{what}")

  def ensure_own(self, nbytes: int) -> slots_lib.SlotFile:
    if self.own is None or self.own.slot_bytes < slots_lib.round_up(nbytes):
      if self.own is not None:
        self.own.close(unlink=True)
      self.own = slots_lib.SlotFile(self._path("own"), nbytes, create=True)
    return self.own

  def ensure_rep(self, origin: int, nbytes: int) -> slots_lib.SlotFile:
    f = self.reps.get(origin)
    if f is None or f.slot_bytes < slots_lib.round_up(nbytes):
      if f is not None:
        f.close(unlink=True)
      f = self.reps[origin] = slots_lib.SlotFile(self._path(f"rep{origin}"), nbytes, create=True)
    return f

  def peer(self, addr: str) -> zmq.Socket:
    if addr not in self.peers:
      s = wire.new_socket(self.ctx, zmq.DEALER)
      s.connect(addr)
      self.peers[addr] = s
    return self.peers[addr]

  def chunks(self, view: np.ndarray):
    mv = memoryview(view)
    return [mv[i:i + self.chunk] for i in range(0, len(mv), self.chunk)] or [mv]

  # -- handlers ------------------------------------------------------------------------------------
  def on_ctl(self, msg: dict):
    kind = msg["type"]
    if kind == "assign":
      self.assign(msg)
    elif kind == "kill_worker":
      self.pending_assign = None
      self.kill_active()
      wire.send(self.ctl, {"type": "killed", "gen": msg["gen"], "t": wire.now()})
    elif kind == "fetch":
      self.fetch(msg)
    elif kind == "spawn_standby":
      self.spawn_standby()
    elif kind == "fault":
      self.fault = msg
    elif kind == "exit":
      return "exit"
    return None

  def assign(self, msg: dict):
    plan = dict(msg["restore"])
    if plan["tier"] == "memory":
      slot = self.own.find(plan["version"]) if self.own is not None else None
      if slot is None:
        wire.send(self.ctl, {"type": "assign_failed", "gen": msg["gen"],
                             "why": f"{self.name} holds no complete own snapshot v{plan['version']}"})
        return
      m = self.own.meta[slot]
      plan.update(slot=slot, crc=m.crc, nbytes=m.nbytes)
    if self.standby is None:  # not warm yet (failure soon after a start): start it when it is
      self.pending_assign = dict(msg, restore=plan)
      self.spawn_standby()
      return
    self.assignment = msg
    start = {k: v for k, v in msg.items() if k not in ("type", "buddies")}
    start.update(type="start", restore=plan, agent_local=self.local_addr)
    wire.send(self.local, start, ident=self.standby["ident"])
    self.active = dict(self.standby, gen=msg["gen"], rank=msg["rank"])
    self.standby = None
    wire.send(self.ctl, {"type": "started", "gen": msg["gen"], "rank": msg["rank"],
                         "pid": self.active["pid"], "t": wire.now()})

  def fetch(self, msg: dict):
    """Spare taking over ``rank``: pull its committed replica from a buddy into our own slot 0."""
    t0 = wire.now()
    for src in msg["sources"]:
      sock = self.peer(src)
      wire.send(sock, {"type": "get", "origin": msg["rank"], "version": msg["version"]})
      if not sock.poll(int(1000 * msg.get("timeout_s", 3.0))):
        # the source may be dead: drop the socket so a late reply cannot be mistaken for another's
        sock.close()
        del self.peers[src]
        continue
      _, rep, frames = wire.recv(sock)
      if not rep.get("ok"):
        continue
      own = self.ensure_own(rep["nbytes"])
      slot = 0
      own.meta[slot] = slots_lib.SlotMeta()
      view, off = own.view(slot), 0
      for fr in frames:
        b = np.frombuffer(fr.buffer, np.uint8)
        view[off:off + b.size] = b
        off += b.size
      own.meta[slot] = slots_lib.SlotMeta(version=rep["version"], nbytes=rep["nbytes"], crc=rep["crc"],
                                          gen=rep["gen"], complete=off == rep["nbytes"])
      if own.verify(slot):
        wire.send(self.ctl, {"type": "fetched", "ok": True, "rank": msg["rank"], "version": msg["version"],
                             "source": src, "bytes": off, "t0": t0, "t": wire.now()})
        return
      own.meta[slot] = slots_lib.SlotMeta()
    wire.send(self.ctl, {"type": "fetched", "ok": False, "rank": msg["rank"], "version": msg["version"],
                         "t0": t0, "t": wire.now()})

  def on_local(self, ident: bytes, msg: dict):
    kind = msg["type"]
    if kind == "standby_ready":
      if not self.spawning or msg["pid"] in self.exited:
        return
      self.spawning, self.spawning_pid = False, None
      self.standby = {"pid": msg["pid"], "ident": ident}
      wire.send(self.ctl, {"type": "standby_ready", "pid": msg["pid"], "import_s": msg["import_s"]})
      if self.pending_assign is not None:
        msg, self.pending_assign = self.pending_assign, None
        self.assign(msg)
    elif kind == "alloc":
      f = self.ensure_own(msg["nbytes"])
      wire.send(self.local, {"type": "alloc_ok", "path": f.path}, ident=ident)
    elif kind == "stored":
      self.replicate(msg)

  def replicate(self, msg: dict):
    own = self.own
    own.meta[msg["slot"]] = slots_lib.SlotMeta(version=msg["version"], nbytes=msg["nbytes"], crc=msg["crc"],
                                               gen=msg["gen"], complete=True)
    wire.send(self.ctl, {"type": "stored", "rank": msg["rank"], "version": msg["version"], "gen": msg["gen"],
                         "t_stored": msg["t"], "t": wire.now()})
    header = {"type": "replica", "origin": msg["rank"], "version": msg["version"], "gen": msg["gen"],
              "crc": msg["crc"], "nbytes": msg["nbytes"], "protect": msg["protect"]}
    payload = self.chunks(own.view(msg["slot"], msg["nbytes"]))
    die = self.fault is not None and self.fault.get("kind") == "replication" and msg["version"] >= self.fault["version"]
    buddies = self.assignment["buddies"]
    for i, addr in enumerate(buddies):
      if die and i == len(buddies) - 1:  # r=1: nothing reaches the buddy; r>=2: only some buddies get it
        break
      wire.send(self.peer(addr), header, payload=payload)
    if die:  # injected: the node dies while its snapshot is on the wire
      time.sleep(0.002)
      if self.active is not None:
        os.kill(self.active["pid"], signal.SIGKILL)
      os.kill(os.getpid(), signal.SIGKILL)

  def on_data(self, ident: bytes, msg: dict, frames):
    if msg["type"] == "replica":
      f = self.ensure_rep(msg["origin"], msg["nbytes"])
      slot = f.slot_for_write(msg["protect"])
      f.meta[slot] = slots_lib.SlotMeta()  # incomplete until every byte is in
      view, off = f.view(slot), 0
      for fr in frames:
        b = np.frombuffer(fr.buffer, np.uint8)
        view[off:off + b.size] = b
        off += b.size
      f.meta[slot] = slots_lib.SlotMeta(version=msg["version"], nbytes=msg["nbytes"], crc=msg["crc"],
                                        gen=msg["gen"], complete=off == msg["nbytes"])
      # crc is verified when the replica is restored (fetch), not here: it would double the CPU cost
      wire.send(self.ctl, {"type": "ack", "origin": msg["origin"], "version": msg["version"], "gen": msg["gen"],
                           "t": wire.now()})
    elif msg["type"] == "get":
      f = self.reps.get(msg["origin"])
      slot = f.find(msg["version"]) if f is not None else None
      if slot is None:
        wire.send(self.data, {"ok": False}, ident=ident)
        return
      m = f.meta[slot]
      wire.send(self.data, {"ok": True, "version": m.version, "nbytes": m.nbytes, "crc": m.crc, "gen": m.gen},
                payload=self.chunks(f.view(slot, m.nbytes)), ident=ident)

  # -- loop ----------------------------------------------------------------------------------------
  def run(self, hb_s: float = 0.25, ctl_timeout_s: float = 30.0):
    """Serves until the controller says exit, or is silent for ``ctl_timeout_s`` (it died: nobody else would
    unlink this node's shared memory). A SIGTERM (the local launcher's death, PR_SET_PDEATHSIG) ends it too."""
    wire.send(self.ctl, {"type": "hello", "pid": os.getpid(), "data_addr": self.data_addr,
                         "local_addr": self.local_addr})
    last_ctl = time.time()
    self.start_zygote()
    self.spawn_standby()
    poller = zmq.Poller()
    for s in (self.ctl, self.data, self.local):
      poller.register(s, zmq.POLLIN)
    poller.register(self.zygote.stdout.fileno(), zmq.POLLIN)
    last_hb = 0.0
    while True:
      events = dict(poller.poll(10))
      if self.ctl in events:
        last_ctl = time.time()
        _, msg, _ = wire.recv(self.ctl)
        if self.on_ctl(msg) == "exit":
          return
      elif time.time() - last_ctl > ctl_timeout_s:
        print(f"{self.name}: no word from the controller for {ctl_timeout_s:.0f}s: cleaning up and exiting", flush=True)
        return
      if self.local in events:
        ident, msg, _ = wire.recv(self.local, router=True)
        self.on_local(ident, msg)
      if self.data in events:
        ident, msg, frames = wire.recv(self.data, router=True)
        self.on_data(ident, msg, frames)
      if self.zygote.stdout.fileno() in events:
        for words in self.zygote_lines():
          self.on_zygote(words)
      if self.zygote.poll() is not None:  # the fork server died: everything it forked died with it
        poller.unregister(self.zygote.stdout.fileno())
        for pid in [(self.active or {}).get("pid"), (self.standby or {}).get("pid"), self.spawning_pid]:
          if pid:
            self.on_zygote(["exit", str(pid), "-9"])
        self.start_zygote()
        poller.register(self.zygote.stdout.fileno(), zmq.POLLIN)
        self.spawn_standby()
      now = time.time()
      if now - last_hb >= hb_s:
        last_hb = now
        wire.send(self.ctl, {"type": "hb", "t": wire.now()})


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--name", required=True)
  ap.add_argument("--controller", required=True)
  ap.add_argument("--run-id", required=True)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--heartbeat-s", type=float, default=0.25)
  ap.add_argument("--chunk-mb", type=int, default=4)
  ap.add_argument("--controller-timeout-s", type=float, default=30.0)
  args = ap.parse_args(argv)

  def on_term(signum, _frame):  # the launcher died (PR_SET_PDEATHSIG) or someone asked us to stop
    raise SystemExit(128 + signum)
  signal.signal(signal.SIGTERM, on_term)
  # Ctrl-C reaches the whole process group; the launcher turns it into a stop with a checkpoint, so the agent
  # (and the zygote and workers it starts, which inherit this) must not die of it first
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  agent = None
  try:
    agent = Agent(args.name, args.controller, args.run_id, args.workdir)
    agent.chunk = args.chunk_mb << 20
    agent.run(args.heartbeat_s, args.controller_timeout_s)
  finally:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish cleaning up even if told again
    if agent is not None:
      agent.shutdown()
    os._exit(0)


if __name__ == "__main__":
  main()
