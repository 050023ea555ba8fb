"""Worker side of the replicated-state layer: snapshots off the critical path.

After every step the training loop *offers* the new state (a reference, no copy). A background
thread copies this process's shards into the agent's shared-memory slot (preallocated and reused),
checksums them and tells the agent, which replicates the bytes to the buddies; the controller
commits a version once every rank's own copy and all its replicas are acknowledged. The next
snapshot starts only after the previous one is committed, so one slot always holds the last
committed version; if replication lags, intermediate versions are skipped (never queued).

The train step must not donate the offered state (``build_step(..., donate=False)``): the copy
reads it while the next step runs. On GPU the same thread would start ``copy_to_host_async`` and
copy into pinned buffers; on CPU the "device" buffer is host memory and the copy is a memcpy.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import zmq

from resilience import layout as layout_lib
from resilience import slots as slots_lib
from resilience import wire


class Snapshotter:
  def __init__(self, ctx: zmq.Context, agent_addr: str, pub_addr: str, slot_file: slots_lib.SlotFile,
               layout: layout_lib.Layout, gen: int, rank: int, committed: int, committed_slot: Optional[int]):
    self.ctx, self.agent_addr, self.pub_addr = ctx, agent_addr, pub_addr
    self.slots, self.layout, self.gen, self.rank = slot_file, layout, gen, rank
    self.committed = committed  # last globally committed version (all ranks, all replicas)
    self.committed_slot = committed_slot
    self._last_slot = committed_slot
    self.last_written = committed  # newest version we handed to the agent
    self.pending = None  # (version, state): newest offered, not yet copied
    self.cv = threading.Condition()
    self.busy = False
    self.stop_flag = False
    self.copy_s, self.crc_s, self.skipped, self.written = [], [], 0, 0
    self.thread = threading.Thread(target=self._run, name="snapshotter", daemon=True)
    self.thread.start()

  def offer(self, version: int, state) -> None:
    with self.cv:
      if self.pending is not None:
        self.skipped += 1
      self.pending = (version, state)
      self.cv.notify_all()

  def drain(self, timeout: float = 30.0) -> None:
    """Waits until no copy is in flight and nothing is pending (before a donated step reuses buffers)."""
    end = time.time() + timeout
    with self.cv:
      while (self.busy or self.pending is not None) and time.time() < end:
        self.cv.wait(0.01)

  def wait_committed(self, version: int, timeout: float) -> bool:
    end = time.time() + timeout
    with self.cv:
      while self.committed < version and time.time() < end:
        self.cv.wait(0.01)
      return self.committed >= version

  def close(self):
    with self.cv:
      self.stop_flag = True
      self.cv.notify_all()
    self.thread.join(timeout=5)

  def _run(self):
    sub = wire.new_socket(self.ctx, zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(self.pub_addr)
    agent = wire.new_socket(self.ctx, zmq.DEALER)
    agent.connect(self.agent_addr)
    try:
      while True:
        self._drain_commits(sub)
        with self.cv:
          if self.stop_flag:
            return
          ready = self.pending is not None and self.committed >= self.last_written
          if ready:
            version, state = self.pending
            self.pending = None
            self.busy = True
        if not ready:
          sub.poll(5)
          continue
        try:
          self._write(agent, version, state)
        finally:
          del state
          with self.cv:
            self.busy = False
            self.cv.notify_all()
    finally:
      sub.close()
      agent.close()

  def _drain_commits(self, sub):
    while sub.poll(0):
      _, msg, _ = wire.recv(sub)
      if msg.get("type") == "commit" and msg["gen"] == self.gen and msg["version"] > self.committed:
        with self.cv:
          self.committed = msg["version"]
          if self.committed == self.last_written:
            self.committed_slot = self._last_slot
          self.cv.notify_all()

  def _write(self, agent, version: int, state):
    slot = 1 - self.committed_slot if self.committed_slot is not None else 0
    n = self.layout.nbytes
    t0 = time.perf_counter()
    layout_lib.pack(state, self.layout, self.slots.view(slot, n))
    t1 = time.perf_counter()
    crc = slots_lib.checksum(self.slots.view(slot, n))
    t2 = time.perf_counter()
    self.copy_s.append(t1 - t0)
    self.crc_s.append(t2 - t1)
    self._last_slot = slot
    self.last_written = version
    self.written += 1
    wire.send(agent, {"type": "stored", "version": version, "slot": slot, "crc": crc, "nbytes": n,
                      "gen": self.gen, "rank": self.rank, "protect": self.committed, "t": wire.now()})
