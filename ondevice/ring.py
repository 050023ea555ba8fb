"""Pipelined-ring inference: M device processes on localhost, each owning k layer windows.

A forward pass of T tokens goes round the ring k times: the head (rank 0, this process) embeds, runs
its window of cycle 0 and sends to rank 1, ..., rank M-1 sends back to the head, which runs its
window of cycle 1, and so on; after cycle k-1 the head applies the output layer. Each device
prefetches its next window right after sending (device.py), so disk reads overlap the other
devices' compute and the links. Transport: pyzmq PUSH/PULL over tcp://127.0.0.1, a message is
[JSON header, raw f32 activations]. Every device keeps the KV cache of its own layers; the header's
``pos0`` says where this pass writes, so a rollback (speculative decoding) needs no extra message.
Emulated time travels in the header (``t``) and includes the sender's link delay.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import sys
from typing import Optional, Sequence

import numpy as np

from ondevice.device import Device, DeviceOptions
from ondevice.emulation import DeviceSpec
from ondevice.errors import PeerError

PEER_TIMEOUT_S = 60.0  # a pass round the ring that takes longer means a device hangs (--peer-timeout)


def free_port_base(n: int) -> int:
  """A base port with n consecutive free ports (best effort; tests run serially per process)."""
  for _ in range(50):
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      base = s.getsockname()[1]
    if base + n < 65535 and all(_port_free(base + i) for i in range(n)):
      return base
  raise RuntimeError("no free localhost ports for the ring")


def _port_free(p: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", p))
      return True
    except OSError:
      return False


def _sockets(rank: int, world: int, base: int):
  import zmq
  ctx = zmq.Context()
  pull = ctx.socket(zmq.PULL)
  pull.bind(f"tcp://127.0.0.1:{base + rank}")
  push = ctx.socket(zmq.PUSH)
  push.setsockopt(zmq.LINGER, 2000)
  push.connect(f"tcp://127.0.0.1:{base + (rank + 1) % world}")
  return ctx, pull, push


def _send(push, header: dict, x: Optional[np.ndarray]):
  payload = b"" if x is None else np.ascontiguousarray(x, np.float32)
  if x is not None:
    header = dict(header, shape=list(x.shape))
  push.send_multipart([json.dumps(header).encode(), payload], copy=False)


def _recv(pull, procs: Sequence = (), timeout_s: float = None, names: Sequence = ()):
  """Receives one message, polling once a second so that a dead device process is reported at once.
  ``timeout_s`` (head): no answer within it = a hanging device. Workers (timeout None) wait for the next
  message as long as their parent, the head, lives."""
  waited = 0.0
  while not pull.poll(1000 if timeout_s is None else min(1000, max(1, int(1000 * timeout_s)))):
    waited += 1.0 if timeout_s is None else min(1.0, timeout_s)
    dead = [(r, p) for r, p in enumerate(procs, 1) if not p.is_alive()]
    if dead:
      r, p = dead[0]
      who = names[r] if r < len(names) else p.name
      raise PeerError(f"ring device {who} (rank {r}) exited with code {p.exitcode} during generation; see its "
                      f"message above, then rerun (or drop that device from the devices file)", rank=r)
    if timeout_s is not None and waited >= timeout_s:
      raise PeerError(f"a ring device did not answer within {timeout_s:g} s, so one hangs; rerun, or raise "
                      f"--peer-timeout for very slow devices", hung=True)
    if timeout_s is None:
      parent = mp.parent_process()
      if parent is not None and not parent.is_alive():
        raise SystemExit(0)  # the head is gone: nothing to serve
  h, p = pull.recv_multipart(copy=False)
  header = json.loads(bytes(h.buffer))
  x = None
  if "shape" in header:
    x = np.frombuffer(p.buffer, np.float32).reshape(header["shape"]).copy()
  return header, x


def _fault_plan(rank: int):
  """Fault injection for reliability tests: ONDEVICE_FAULT="rank=R,after=N,action=kill|stop" makes device R
  SIGKILL or SIGSTOP itself on its N-th forward pass (deterministic, unlike a kill from outside)."""
  spec = os.environ.get("ONDEVICE_FAULT", "")
  if not spec:
    return None
  d = dict(kv.split("=", 1) for kv in spec.split(","))
  if int(d.get("rank", -1)) != rank:
    return None
  return int(d.get("after", 1)), signal.SIGKILL if d.get("action", "kill") == "kill" else signal.SIGSTOP


def _worker(rank: int, world: int, base: int, model_path: str, windows: list, spec: Optional[DeviceSpec],
            opts: DeviceOptions, n_gpu: int, residency: Optional[tuple], env: dict):
  os.environ.update(env)
  from ondevice.errors import InputError
  from ondevice.gguf_check import GGUFError
  try:
    dev = Device(model_path, windows, spec, opts, head=False, n_gpu=n_gpu, residency=residency, rank=rank)
  except (GGUFError, InputError) as e:  # one line, then the head reports this device's exit
    print(f"error: ring device rank {rank}: {e}", file=sys.stderr)
    raise SystemExit(3) from None
  ctx, pull, push = _sockets(rank, world, base)
  if rank == 1:  # readiness token: each rank forwards it only once its own model is loaded
    _send(push, {"op": "ready"}, None)
  fault = _fault_plan(rank)
  n_fwd = 0
  try:
    while True:
      header, x = _recv(pull)
      op = header["op"]
      if op == "ready":  # readiness token travels round to the head
        _send(push, header, None)
      elif op == "fwd":
        n_fwd += 1
        if fault and n_fwd == fault[0]:
          os.kill(os.getpid(), fault[1])
        c = header["cycle"]
        y = dev.run_window(c, x, header["pos0"], header["t"], header.get("bi", False), header.get("lo", False))
        t = dev.clock.now + (spec.link_time(y.nbytes) if spec is not None else 0.0)
        _send(push, dict(header, t=t), y)
        dev.after_send(c)
      elif op == "stats":
        _send(push, dict(header, stats=header["stats"] + [dict(dev.stats(), rank=rank)]), None)
      elif op == "stop":
        _send(push, header, None)
        break
  finally:
    pull.close(0)
    push.close(2000)
    ctx.term()


class RingEngine:
  """Head of the ring; ``forward(tokens, pos0) -> logits`` like a local model. world=1 runs in-process."""

  def __init__(self, model_path: str, windows: Sequence[list], specs: Sequence[Optional[DeviceSpec]],
               opts: DeviceOptions = DeviceOptions(), n_gpu: Sequence[int] = (), threads_per_worker: int = 1,
               residency: Optional[Sequence[Optional[tuple]]] = None, peer_timeout_s: float = PEER_TIMEOUT_S):
    """``residency``: per device (pin, prefetch) bytes per window from Halda (None: the device's own rule).
    ``peer_timeout_s``: a forward pass whose answer takes longer raises PeerError (a hanging device)."""
    self.world = len(windows)
    self.peer_timeout_s = peer_timeout_s
    self.names = [s.name if s is not None else f"rank{r}" for r, s in enumerate(specs)]
    self.k = len(windows[0])
    self.specs = list(specs)
    res = list(residency) if residency else [None] * self.world
    self.head = Device(model_path, windows[0], specs[0], opts, head=True, n_gpu=n_gpu[0] if n_gpu else 0,
                       residency=res[0])
    self.procs: list = []
    self.ctx = None
    if self.world > 1:
      base = free_port_base(self.world)
      env = {"NUMBA_NUM_THREADS": str(threads_per_worker), "OMP_NUM_THREADS": str(threads_per_worker),
             "OPENBLAS_NUM_THREADS": str(threads_per_worker)}
      spawn = mp.get_context("spawn")
      for r in range(1, self.world):
        p = spawn.Process(target=_worker, daemon=True, name=f"ring-rank{r}",
                          args=(r, self.world, base, model_path, windows[r], specs[r], opts,
                                n_gpu[r] if n_gpu else 0, res[r], env))
        p.start()
        self.procs.append(p)
      self.ctx, self.pull, self.push = _sockets(0, self.world, base)
      # wait until every worker is up (token from the last rank); loading may take a while
      header, _ = _recv(self.pull, self.procs, max(self.peer_timeout_s, 600.0), self.names)
      assert header["op"] == "ready"

  @property
  def clock(self):
    return self.head.clock

  def forward(self, tokens, pos0: int, batch_invariant: bool = False, last_only: bool = False) -> np.ndarray:
    """Logits for tokens at positions pos0..; ``batch_invariant``: every token's result equals a one-token
    pass (speculative verification; planes.layers); ``last_only``: only the last token's (GGUFLlama.forward)."""
    h = self.head
    x = h.embed(tokens)
    for c in range(self.k):
      x = h.run_window(c, x, pos0, h.clock.now, batch_invariant, last_only)
      if self.world > 1:
        spec = self.specs[0]
        t = h.clock.now + (spec.link_time(x.nbytes) if spec is not None else 0.0)
        _send(self.push, {"op": "fwd", "cycle": c, "pos0": pos0, "t": t, "bi": batch_invariant, "lo": last_only}, x)
        h.after_send(c)
        header, x = _recv(self.pull, self.procs, self.peer_timeout_s, self.names)
        if header["t"] > h.clock.now:
          h.clock.idle_s += header["t"] - h.clock.now
          h.clock.now = header["t"]
      else:
        h.after_send(c)
    return h.logits(x[-1:] if last_only else x)

  def stats(self) -> list:
    out = [dict(self.head.stats(), rank=0)]
    if self.world > 1:
      _send(self.push, {"op": "stats", "stats": []}, None)
      header, _ = _recv(self.pull, self.procs, self.peer_timeout_s, self.names)
      out += header["stats"]
    return out

  def close(self) -> None:
    graceful = True
    if self.world > 1 and self.ctx is not None:
      try:
        _send(self.push, {"op": "stop"}, None)
        _recv(self.pull, self.procs, 5.0, self.names)
      except Exception:  # noqa: BLE001 - a dead or frozen worker must not keep us from cleaning up the rest
        graceful = False
      self.pull.close(0)
      self.push.close(0)
      self.ctx.term()
      self.ctx = None
    for p in self.procs:
      p.join(timeout=10 if graceful else 0.5)
      if p.is_alive():
        p.kill()
        p.join(timeout=5)
    self.procs = []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
