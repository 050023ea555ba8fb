"""The controller's agents and sockets: launch agent processes, message them, signal their workers, shut down.

One agent per node (``python -m resilience.agent``), spares included; the controller binds a ROUTER (agents), a
PULL (workers report steps, timings, errors) and a PUB (commits) socket.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import zmq

from resilience import wire
from resilience.deathsig import term_with_parent
from resilience.run_state import Node
from resilience.settings import HotswapSettings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kill(pid: Optional[int], sig=signal.SIGKILL):
  if pid:
    try:
      os.kill(pid, sig)
    except ProcessLookupError:
      pass


class Fleet:
  def __init__(self, s: HotswapSettings, workdir: str, run_id: str, lock_fd: Optional[int] = None):
    self.s, self.workdir, self.run_id = s, workdir, run_id
    self.lock_fd = lock_fd  # the workdir lock: agents inherit it, so it is free only once all of them are gone
    self.ctx = zmq.Context()
    self.router = wire.new_socket(self.ctx, zmq.ROUTER)
    self.router_addr = wire.bind_random(self.router)
    self.pull = wire.new_socket(self.ctx, zmq.PULL)
    self.pull_addr = wire.bind_random(self.pull)
    self.pub = wire.new_socket(self.ctx, zmq.PUB)
    self.pub_addr = wire.bind_random(self.pub)
    self.nodes: Dict[str, Node] = {}
    self.spare_counter = 0
    self.last_ping = 0.0

  def launch(self, name: str) -> Node:
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

  def replenish(self):
    """A node was retired: boot a replacement spare if the settings ask for it."""
    if self.s.respawn_spares:
      self.spare_counter += 1
      self.launch(f"repl{self.spare_counter}")

  def spares(self) -> List[str]:
    return [n.name for n in self.nodes.values() if n.role == "spare" and n.alive and n.standby_ready]

  def send(self, name: str, msg: dict):
    wire.send(self.router, msg, ident=name.encode())

  def publish(self, msg: dict):
    wire.send(self.pub, msg)

  def ping(self, now: float):
    """Agents clean up and exit when the controller is silent for controller_timeout_s (it died)."""
    if now - self.last_ping > self.s.heartbeat_s:
      self.last_ping = now
      for node in self.nodes.values():
        if node.alive:
          self.send(node.name, {"type": "ping"})

  def kill_node(self, name: str):
    """Host loss: SIGKILL of its worker and agent (its shared memory and held replicas are gone)."""
    node = self.nodes[name]
    kill(node.worker_pid)
    node.proc.kill()

  def poll(self, timeout_ms: int, on_agent: Callable[[str, dict], None], on_worker: Callable[[dict], None]):
    """Waits up to timeout_ms for a message, then hands every queued one to its handler (agents first)."""
    poller = zmq.Poller()
    poller.register(self.router, zmq.POLLIN)
    poller.register(self.pull, zmq.POLLIN)
    socks = dict(poller.poll(timeout_ms))
    while self.router.poll(0):
      ident, msg, _ = wire.recv(self.router, router=True)
      on_agent(ident.decode(), msg)
    while self.pull.poll(0):
      _, msg, _ = wire.recv(self.pull)
      on_worker(msg)
    return socks

  def stop_agents(self):
    """Asks every live agent to exit, then kills whatever is left after 3 s (agents and workers)."""
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
      kill(node.worker_pid)

  def close_sockets(self):
    self.router.close()
    self.pull.close()
    self.pub.close()
    self.ctx.term()
