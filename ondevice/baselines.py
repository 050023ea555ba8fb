"""A dllama-like tensor-parallel baseline on emulated devices (for ``python -m ondevice.bench --suite ring``).

distributed-llama splits every layer's matrices equally across 2^n nodes (tensor parallelism; at most as many
nodes as KV heads); a root node holds the embedding and output layer and, twice per layer, gathers the
workers' slices and broadcasts the next input over TCP. This class runs that schedule on the same emulated
clock as the ring (emulation.py): the layer is computed for real, in this process, and each device is
charged (1) the page-cache reads of its 1/M slice of the layer's bytes through its own emulated page cache
(LRU, RAM budget minus its share of the KV cache, its disk speed), then (2) 1/M of the layer's measured
compute time times its cpu_slowdown; the layer ends when the slowest device is done, plus two syncs, each
the slowest worker's link time for its slice of the activations plus the root's link time to send the full
activations (a broadcast through a switch). Optimistic for dllama: its split is assumed free of compute
overhead. Speculative decoding is not modelled here.
"""
from __future__ import annotations

import math
import time
from typing import Sequence

from ondevice.emulation import Clock, DeviceSpec, EmulatedCache
from ondevice.forward import GGUFLlama
from ondevice.weights import MappedGGUF


class TensorParallelEmulation:
  """Engine interface of ring.RingEngine: ``forward(tokens, pos0) -> logits``, ``clock``, ``head``, ``stats``."""

  def __init__(self, model_path: str, specs: Sequence[DeviceSpec], max_len: int, chunk: int = 4096):
    self.mapped = MappedGGUF(model_path)
    self.model = GGUFLlama(self.mapped, max_len=max_len)
    self.cache = self.model.new_cache()
    self.specs = list(specs)
    cfg = self.model.cfg
    M = len(self.specs)
    if cfg.n_kv_heads % M:
      raise ValueError(f"dllama-like split needs the KV heads ({cfg.n_kv_heads}) divisible by the devices ({M})")
    self.M, self.chunk = M, chunk
    kv = 2 * max_len * cfg.n_kv_heads * cfg.hd * 4 * cfg.n_layers / M
    self.caches = [EmulatedCache(s.ram_bytes - kv, s.disk_Bps, chunk) for s in self.specs]
    self.clock = Clock()
    self.head = self  # what generate.py reads: head.emulated, head.model, head.clock
    self.emulated = True
    self.head_ranges = self.mapped.head_ranges()

  def _share(self, i: int, m: int) -> tuple:
    a, b = self.mapped.info.layer_range(i)
    lo = a + (b - a) * m // self.M
    hi = a + (b - a) * (m + 1) // self.M
    return lo // self.chunk * self.chunk, hi

  def _sync(self, nbytes: int) -> float:
    gather = max((s.link_time(nbytes / self.M) for s in self.specs[1:]), default=0.0)
    return gather + self.specs[0].link_time(nbytes)

  def _timed(self, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0

  def forward(self, tokens, pos0: int, batch_invariant: bool = False, last_only: bool = False):
    t = self.clock.now
    root = self.specs[0]
    for a, b in self.head_ranges:
      t = self.caches[0].access(a, b, t)
    x, w = self._timed(self.model.embed, tokens)
    t += w * root.cpu_slowdown
    act = len(tokens) * self.model.cfg.d_model * 4
    for i in self.model.layer_ids:
      x, w = self._timed(self.model.run_layers, x, pos0, [i], self.cache, batch_invariant, last_only)
      ends = []
      for m, s in enumerate(self.specs):
        ready = self.caches[m].access(*self._share(i, m), t)
        ends.append(ready + w / self.M * s.cpu_slowdown)
      done = max(ends)
      self.clock.disk_wait_s += max(0.0, min(ends) - t - w / self.M)
      self.clock.compute_s += done - t
      t = done + 2 * self._sync(act)
    logits, w = self._timed(self.model.head, x[-1:] if last_only else x)
    t += w * root.cpu_slowdown
    self.clock.now = t
    return logits

  def stats(self) -> list:
    return [{"name": s.name, "rank": m, "emulated_disk_read_mb": c.bytes_read / 2**20,
             "budget_mb": s.ram_bytes / 2**20 if math.isfinite(s.ram_bytes) else None}
            for m, (s, c) in enumerate(zip(self.specs, self.caches))]

  def close(self) -> None:
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
