"""One device of the ring: its layer windows, KV cache, residency policy and (optional) emulation.

Residency policy ("pin + stream", used when the device's share exceeds its memory budget):
windows that fit alongside two streaming windows are pinned (never released); the others are
prefetched right after this device hands its activations on (prima.cpp: recv -> compute -> send ->
prefetch next window) and released right after use, so a streamed window never evicts a pinned one.
Policy "os" does nothing explicit (the page cache / emulated LRU decides), like plain llama.cpp mmap.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np

from ondevice.emulation import Clock, DeviceSpec, EmulatedCache
from ondevice.forward import GGUFLlama
from ondevice.weights import MappedGGUF


@dataclasses.dataclass(frozen=True)
class DeviceOptions:
  prefetch: bool = True
  policy: str = "pin_stream"  # or "os"
  real_io: bool = False  # also issue real madvise/fadvise (off under emulation: keeps the real cache warm)
  chunk_bytes: int = 64 << 10  # emulated page-cache granularity
  max_len: Optional[int] = None


class Device:
  def __init__(self, model_path: str, windows: list, spec: Optional[DeviceSpec], opts: DeviceOptions,
               head: bool = False):
    self.mapped = MappedGGUF(model_path)
    self.windows = [list(w) for w in windows]  # [cycle] -> layer ids
    layers = [i for w in self.windows for i in w]
    self.model = GGUFLlama(self.mapped, layers=layers, head=head, max_len=opts.max_len)
    self.cache = self.model.new_cache()
    self.spec, self.opts, self.head = spec, opts, head
    self.clock = Clock()
    self.emulated = spec is not None and spec.emulated
    self.ecache = EmulatedCache(spec.ram_bytes, spec.disk_Bps, opts.chunk_bytes) if self.emulated else None
    self.ranges = [self.mapped.layers_range(w) if w else (0, 0) for w in self.windows]
    self.head_ranges = self.mapped.head_ranges() if head else []
    self.pinned = self._choose_pinned()
    self.n_gpu = 0  # layers per window on the emulated GPU (set by the planner)

  # ------------------------------------------------------------------ residency
  def _choose_pinned(self) -> set:
    sizes = [b - a for a, b in self.ranges]
    budget = self.spec.ram_bytes if self.spec is not None else float("inf")
    budget -= sum(b - a for a, b in self.head_ranges)
    if self.opts.policy == "os" or sum(sizes) <= budget:
      return set(range(len(self.windows)))
    room = budget - 2 * max(sizes)
    pinned, used = set(), 0
    for c, s in enumerate(sizes):
      if used + s <= room:
        pinned.add(c)
        used += s
    return pinned

  def streamed(self) -> list:
    return [c for c in range(len(self.windows)) if c not in self.pinned and self.windows[c]]

  def _access(self, start: int, end: int) -> None:
    if self.ecache is not None and end > start:
      t0 = self.clock.now
      self.clock.now = self.ecache.access(start, end, t0)
      self.clock.disk_wait_s += self.clock.now - t0

  def _timed(self, fn, *args, gpu_fraction: float = 0.0):
    t0 = time.perf_counter()
    out = fn(*args)
    wall = time.perf_counter() - t0
    if self.emulated:
      s = self.spec
      frac_cpu = 1.0 - gpu_fraction
      dt = wall * s.cpu_slowdown * frac_cpu + (wall * gpu_fraction / s.gpu_speedup if s.gpu_speedup else 0.0)
    else:
      dt = wall
    self.clock.now += dt
    self.clock.compute_s += dt
    return out

  # ------------------------------------------------------------------ compute
  def embed(self, tokens) -> np.ndarray:
    for a, b in self.head_ranges:
      self._access(a, b)
    return self._timed(self.model.embed, tokens)

  def logits(self, x_TxD) -> np.ndarray:
    return self._timed(self.model.head, x_TxD)

  def run_window(self, cycle: int, x_TxD: np.ndarray, pos0: int, t_in: float) -> np.ndarray:
    """recv (t_in) -> wait for the window's weights -> compute. Caller sends, then calls after_send."""
    if t_in > self.clock.now:
      self.clock.idle_s += t_in - self.clock.now
      self.clock.now = t_in
    layers = self.windows[cycle]
    if not layers:
      return x_TxD
    self._access(*self.ranges[cycle])
    g = min(self.n_gpu, len(layers)) / len(layers)
    return self._timed(self.model.run_layers, x_TxD, pos0, layers, self.cache, gpu_fraction=g)

  def after_send(self, cycle: int) -> None:
    """Release the window just used (if streamed) and prefetch the next one (if streamed)."""
    k = len(self.windows)
    if cycle not in self.pinned and self.windows[cycle]:
      self._release(*self.ranges[cycle])
    nxt = (cycle + 1) % k
    if self.opts.prefetch and self.windows[nxt] and (nxt not in self.pinned or self.opts.policy == "os"):
      self._prefetch(*self.ranges[nxt])

  def _release(self, a: int, b: int) -> None:
    if self.ecache is not None:
      self.ecache.release(a, b)
    if self.opts.real_io:
      self.mapped.release(a, b)

  def _prefetch(self, a: int, b: int) -> None:
    if self.ecache is not None:
      self.ecache.prefetch(a, b, self.clock.now)
    if self.opts.real_io:
      self.mapped.prefetch(a, b)

  def stats(self) -> dict:
    d = {"name": self.spec.name if self.spec else "local", "layers": sum(len(w) for w in self.windows),
         "windows": [len(w) for w in self.windows], "pinned_windows": sorted(self.pinned),
         "share_mb": sum(b - a for a, b in self.ranges) / 2**20}
    d.update(self.clock.as_dict() if self.emulated else {"clock": "wall", "compute_s": self.clock.compute_s})
    if self.ecache is not None:
      d.update(emulated_disk_read_mb=self.ecache.bytes_read / 2**20, emulated_resident_mb=self.ecache.resident_bytes() / 2**20,
               budget_mb=self.spec.ram_bytes / 2**20)
    return d
