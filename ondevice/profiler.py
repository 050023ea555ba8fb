"""Device profiler: compute per layer (per quant type), memory bandwidth, disk read, RAM, link.

Measured on this machine; an emulated device's numbers are derived from them (cpu_slowdown,
disk_Bps, link) by ``planner.py``. Every figure is a median of a few repetitions.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np


def _median_time(fn, reps: int = 5) -> float:
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def layer_time(model_path: str, reps: int = 5, T: int = 1, repack: bool = True) -> float:
  """Seconds per layer of one decode step of this file (its quant type): a step over all its layers, as a device
  runs them (one fused call on the planes path, so the per-call overhead is shared), divided by the layer
  count; median of ``reps``. ``repack=False``: the kernels on the file's own pages (devices with real I/O)."""
  from ondevice.forward import GGUFLlama
  from ondevice.weights import MappedGGUF
  m = GGUFLlama(MappedGGUF(model_path), head=True, max_len=64, repack=repack)
  cache = m.new_cache()
  x = m.embed([1] * T)
  m.run_layers(x, 0, m.layer_ids, cache)  # warm-up (numba compile, page-in)
  return _median_time(lambda: m.run_layers(x, 8, m.layer_ids, cache), reps) / len(m.layer_ids)


def head_time(model_path: str, reps: int = 5, repack: bool = True) -> float:
  from ondevice.forward import GGUFLlama
  from ondevice.weights import MappedGGUF
  m = GGUFLlama(MappedGGUF(model_path), layers=[], head=True, max_len=64, repack=repack)
  m.head(m.embed([1]))
  return _median_time(lambda: m.head(m.embed([1])), reps)


def memory_bandwidth(nbytes: int = 64 << 20) -> float:
  a = np.ones(nbytes // 8)
  b = np.empty_like(a)
  return 2 * nbytes / _median_time(lambda: np.copyto(b, a), 5)


def disk_read(path: str, nbytes: int = 64 << 20) -> float:
  """Cold sequential read throughput of ``path`` (pages evicted with posix_fadvise first)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    size = min(nbytes, os.fstat(fd).st_size)
    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    got = 0
    while got < size:
      chunk = os.pread(fd, min(1 << 20, size - got), got)
      if not chunk:
        break
      got += len(chunk)
    return got / max(time.perf_counter() - t0, 1e-9)
  finally:
    os.close(fd)


def link(n_msgs: int = 50, nbytes: int = 64 << 10) -> dict:
  """Localhost pyzmq round trip: latency of tiny messages and throughput of ``nbytes`` messages."""
  import threading

  import zmq
  ctx = zmq.Context()
  a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
  port = a.bind_to_random_port("tcp://127.0.0.1")
  b.connect(f"tcp://127.0.0.1:{port}")

  def echo(n):
    for _ in range(n):
      b.send(b.recv(copy=False), copy=False)
  out = {}
  for name, size in (("latency", 8), ("bw", nbytes)):
    msg = bytes(size)
    t = threading.Thread(target=echo, args=(n_msgs,))
    t.start()
    t0 = time.perf_counter()
    for _ in range(n_msgs):
      a.send(msg)
      a.recv()
    dt = (time.perf_counter() - t0) / n_msgs
    t.join()
    out[name] = dt
  a.close(0)
  b.close(0)
  ctx.term()
  return {"link_latency_s": out["latency"] / 2, "link_Bps": 2 * nbytes / max(out["bw"] - out["latency"], 1e-9)}


def ram_available() -> int:
  import psutil
  return int(psutil.virtual_memory().available)


def profile(model_path: str) -> dict:
  d = {"layer_s": layer_time(model_path), "head_s": head_time(model_path), "mem_Bps": memory_bandwidth(),
       "disk_Bps": disk_read(model_path), "ram_available": ram_available(), "cpus": os.cpu_count()}
  d.update(link())
  return d
