"""One device of the ring: its layer windows, KV cache, residency policy and (optional) emulation.

Residency policies
* ``plan`` (Halda): every window's CPU bytes are split as Halda planned (halda.py): the first ``pin``
  bytes stay resident, the next ``prefetch`` bytes are read into a buffer while the rest of the ring
  works (prima.cpp: recv -> compute -> send -> prefetch next window; here the used buffer is released
  first, so the next window's read-ahead never evicts anything still needed), and the remaining bytes
  are faulted in when the window runs and not kept. Halda's memory constraint guarantees that pinned
  bytes + one buffer + KV fit the budget, which is what removes the prefetch-release conflict.
  Without a Halda residency (manual windows) the device derives one by the same rule (halda.residency).
* ``os``: nothing explicit, the (emulated) LRU page cache decides, like plain llama.cpp / exo mmap;
  with ``prefetch`` the whole next window is read ahead after sending, as prima.cpp does, which for a
  window larger than RAM evicts its own first pages before use (the prefetch-release conflict).
GPU layers (the last n of each window, as in prima.cpp) are VRAM-resident and read no disk.
"""
from __future__ import annotations

import dataclasses
import math
import mmap
import os
import time
from typing import Optional

import numpy as np

from ondevice.emulation import Clock, DeviceSpec, EmulatedCache
from ondevice.forward import GGUFLlama
from ondevice.weights import MappedGGUF


@dataclasses.dataclass(frozen=True)
class DeviceOptions:
  prefetch: bool = True
  policy: str = "plan"  # or "os"
  real_io: bool = False  # also issue real madvise/fadvise (off under emulation: keeps the real cache warm)
  chunk_bytes: int = 64 << 10  # emulated page-cache granularity
  max_len: Optional[int] = None
  rank_paths: tuple = ()  # real I/O: one copy of the file per rank (separate page caches, as separate devices)
  blkio_cgroups: tuple = ()  # real I/O: per rank, a blkio cgroup directory to join (kernel disk throttle)


class Device:
  def __init__(self, model_path: str, windows: list, spec: Optional[DeviceSpec], opts: DeviceOptions,
               head: bool = False, n_gpu: int = 0, residency: Optional[tuple] = None, rank: int = 0):
    if opts.policy not in ("plan", "os"):
      raise ValueError(f"residency policy {opts.policy!r} unknown; use 'plan' or 'os'")
    if opts.blkio_cgroups:  # join this rank's throttled cgroup before touching the file
      with open(os.path.join(opts.blkio_cgroups[rank], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    if opts.rank_paths:
      model_path = opts.rank_paths[rank]
    self.mapped = MappedGGUF(model_path)
    self.windows = [list(w) for w in windows]  # [cycle] -> layer ids
    layers = [i for w in self.windows for i in w]
    # Planes (repacked, fast) unless real I/O is on: then the kernels must touch the file's own pages,
    # which is what madvise/fadvise prefetch and release act on.
    self.model = GGUFLlama(self.mapped, layers=layers, head=head, max_len=opts.max_len,
                           repack=not opts.real_io)
    self.cache = self.model.new_cache()
    self.spec, self.opts, self.head = spec, opts, head
    self.n_gpu = n_gpu  # layers per window on the emulated GPU (VRAM-resident)
    self.clock = Clock()
    # With real I/O the device's disk and memory are real (wall clock, madvise/fadvise on its own file copy).
    self.emulated = spec is not None and spec.emulated and not opts.real_io
    cfg = self.mapped.info.cfg
    cpu_layers = [i for w in self.windows for i in w[:max(0, len(w) - n_gpu)]]
    self.kv_bytes = 2 * (opts.max_len or cfg.max_seq_len) * cfg.n_kv_heads * cfg.hd * 4 * len(cpu_layers)
    self.head_ranges = self.mapped.head_ranges() if head else []
    budget = spec.ram_bytes - self.kv_bytes if spec is not None else math.inf
    self.ecache = EmulatedCache(budget, spec.disk_Bps, opts.chunk_bytes) if self.emulated else None
    self.cpu_ranges = [self.mapped.layers_range(w[:len(w) - n_gpu]) if len(w) > n_gpu else (0, 0)
                       for w in self.windows]
    self.residency = residency if residency is not None else self._default_residency(budget)
    self.parts = [self._split(a, b) for a, b in self.cpu_ranges]
    if opts.real_io:
      self._start_real_io()

  def _start_real_io(self) -> None:
    """Cold start on the device's own file: nothing cached, no kernel read-around (the plan says what to read),
    then the pinned parts read once and kept."""
    m = self.mapped
    m.mm.madvise(mmap.MADV_RANDOM)
    m.release(0, len(m.mm))
    if self.opts.policy == "plan":
      for pin, _, _ in self.parts:
        if pin[1] > pin[0]:
          m.prefetch(*pin, touch=True)
      for a, b in self.head_ranges:
        m.prefetch(a, b, touch=True)

  # ------------------------------------------------------------------ residency
  def _default_residency(self, budget: float) -> tuple:
    """(pin, prefetch) bytes per window when no Halda plan is given: Halda's rule with an unlimited disk
    budget (pin what is left after one buffer; for k = 1 pin what fits, no buffer)."""
    s = max(b - a for a, b in self.cpu_ranges)
    ram = budget - sum(b - a for a, b in self.head_ranges)
    k = len(self.windows)
    if not math.isfinite(ram) or k * s <= ram:
      return float(s), 0.0
    if k == 1:
      return max(0.0, ram), 0.0
    x = min(s, max(0.0, ram))
    return max(0.0, (ram - x) / k), x

  def _split(self, a: int, b: int) -> tuple:
    """[a, b) -> (pinned, prefetched, synchronous) sub-ranges."""
    p, x = self.residency
    ch = self.opts.chunk_bytes
    # Round the pinned and buffered parts DOWN to whole chunks (pages): a single chunk over the budget
    # makes an LRU buffer evict its own first chunks, and then every chunk after them (measured: the
    # whole buffer re-read per window when rounding up by one page per window).
    if p >= b - a:  # the whole window is pinned
      return (a, b), (b, b), (b, b)
    p_end = max(a, (a + int(p)) // ch * ch)
    x_end = min(b, max(p_end, (p_end + int(x)) // ch * ch))
    return (a, p_end), (p_end, x_end), (x_end, b)

  def _access(self, start: int, end: int, mode: str = "lru") -> None:
    if self.ecache is not None and end > start:
      t0 = self.clock.now
      self.clock.now = self.ecache.access(start, end, t0, mode)
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
      self._access(a, b, "pin" if self.opts.policy == "plan" else "lru")
    return self._timed(self.model.embed, tokens)

  def logits(self, x_TxD) -> np.ndarray:
    return self._timed(self.model.head, x_TxD)

  def run_window(self, cycle: int, x_TxD: np.ndarray, pos0: int, t_in: float,
                 batch_invariant: bool = False, last_only: bool = False) -> np.ndarray:
    """recv (t_in) -> wait for the window's weights -> compute. Caller sends, then calls after_send."""
    if t_in > self.clock.now:
      self.clock.idle_s += t_in - self.clock.now
      self.clock.now = t_in
    layers = self.windows[cycle]
    if not layers:
      return x_TxD
    if self.opts.policy == "plan":
      pin, buf, sync = self.parts[cycle]
      self._access(*pin, mode="pin")
      self._access(*buf, mode="lru")
      self._access(*sync, mode="stream")
      if self.opts.real_io and sync[1] > sync[0]:
        self.mapped.prefetch(*sync)  # read the streamed part now; the kernels' page faults wait for it
    else:
      self._access(*self.cpu_ranges[cycle])
    g = min(self.n_gpu, len(layers)) / len(layers)
    y = self._timed(self.model.run_layers, x_TxD, pos0, layers, self.cache, batch_invariant, last_only,
                    gpu_fraction=g)
    if self.opts.real_io and self.opts.policy == "plan" and self.parts[cycle][2][1] > self.parts[cycle][2][0]:
      self.mapped.release(*self.parts[cycle][2])  # streamed through, not kept
    return y

  def after_send(self, cycle: int) -> None:
    """Release the buffer just used and read ahead the next window (policy ``plan``); or, with policy ``os``,
    read ahead the whole next window and leave eviction to the LRU (prima.cpp's runtime)."""
    if not self.opts.prefetch:
      return
    nxt = (cycle + 1) % len(self.windows)
    if self.opts.policy == "plan":
      buf = self.parts[cycle][1]
      if buf[1] > buf[0]:
        self._release(*buf)
      nbuf = self.parts[nxt][1]
      if nbuf[1] > nbuf[0]:
        self._prefetch(*nbuf)
    elif self.windows[nxt]:
      self._prefetch(*self.cpu_ranges[nxt])

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
         "windows": [len(w) for w in self.windows], "policy": self.opts.policy,
         "pin_prefetch_mb_per_window": [round(v / 2**20, 3) for v in self.residency],
         "share_mb": sum(b - a for a, b in self.cpu_ranges) / 2**20}
    d.update(self.clock.as_dict() if self.emulated else {"clock": "wall", "compute_s": self.clock.compute_s})
    if self.opts.real_io:
      from ondevice.weights import io_counters
      d.update(real_read_bytes=io_counters().get("read_bytes", 0), resident_mb=self.mapped.resident_bytes() / 2**20)
    if self.ecache is not None:
      d.update(emulated_disk_read_mb=self.ecache.bytes_read / 2**20,
               emulated_resident_mb=self.ecache.resident_bytes() / 2**20,
               budget_mb=self.spec.ram_bytes / 2**20, kv_mb=self.kv_bytes / 2**20)
    return d
