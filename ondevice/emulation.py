"""Device emulation on one machine: memory budget, disk throttle, compute slow-down, link delay.

Two CPU cores cannot run four devices' prefetches, computes and links concurrently in real time, and
this machine's page cache holds any file we use. So emulated devices keep an **emulated clock**:
* compute: the real wall time of the real computation, times ``cpu_slowdown``;
* disk: an emulated page cache (chunk-granular LRU with the device's byte budget) in front of an
  emulated disk that serves ``disk_Bps``; a miss costs chunk/disk_Bps of emulated time, prefetches
  run on the emulated disk in the background (they overlap compute and communication) and can evict
  what they will need later (prima.cpp's prefetch-release conflict arises by itself);
* link: latency + bytes / link_Bps per message.
Every number produced this way is labelled ``"clock": "emulated"`` in outputs.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Optional

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  name: str = "local"
  ram_bytes: float = math.inf  # budget for weights (page cache) on this device
  disk_Bps: float = math.inf
  cpu_slowdown: float = 1.0
  vram_bytes: float = 0.0
  gpu_speedup: float = 0.0  # 0 -> no GPU; else GPU layers compute this many times faster
  link_Bps: float = math.inf  # outgoing link to the next device in the ring
  link_latency_s: float = 0.0

  @property
  def emulated(self) -> bool:
    return any(math.isfinite(v) for v in (self.ram_bytes, self.disk_Bps, self.link_Bps)) or \
        self.cpu_slowdown != 1.0 or self.link_latency_s > 0

  def link_time(self, nbytes: int) -> float:
    return self.link_latency_s + (nbytes / self.link_Bps if math.isfinite(self.link_Bps) else 0.0)


def spec_from_dict(d: dict) -> DeviceSpec:
  """Devices-file entry (MB/MBps/ms units, as humans write them) -> DeviceSpec."""
  known = {"name", "ram_mb", "disk_mbps", "cpu_slowdown", "vram_mb", "gpu_speedup", "link_mbps", "link_latency_ms"}
  if not isinstance(d, dict):
    raise ValueError(f"device entry {d!r} must be a mapping like {{name: d1, ram_mb: 512, disk_mbps: 200}}")
  unknown = set(d) - known
  if unknown:
    raise ValueError(f"unknown device keys {sorted(unknown)}; known: {sorted(known)}")
  for k in known - {"name"}:
    if k in d:
      try:
        v = float(d[k])
      except (TypeError, ValueError):
        raise ValueError(f"device {d.get('name', '?')}: {k}={d[k]!r} is not a number") from None
      positive = k in ("ram_mb", "disk_mbps", "cpu_slowdown", "link_mbps")
      if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"device {d.get('name', '?')}: {k}={d[k]!r} must be {'> 0' if positive else '>= 0'}")
  f = lambda k: float(d[k]) * MiB if k in d else math.inf  # noqa: E731
  return DeviceSpec(name=str(d.get("name", "dev")), ram_bytes=f("ram_mb"), disk_Bps=f("disk_mbps"),
                    cpu_slowdown=float(d.get("cpu_slowdown", 1.0)), vram_bytes=float(d.get("vram_mb", 0)) * MiB,
                    gpu_speedup=float(d.get("gpu_speedup", 0.0)), link_Bps=f("link_mbps"),
                    link_latency_s=float(d.get("link_latency_ms", 0.0)) / 1e3)


def load_devices(path: str) -> dict:
  """Reads devices.yaml: {'devices': [...], 'k': int|'auto', 'windows': [[...], ...]|None, 'prefetch': bool}."""
  import yaml
  with open(path) as f:
    doc = yaml.safe_load(f) or {}
  if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list) or not doc["devices"]:
    raise ValueError(f"{path}: needs a non-empty 'devices:' list (see ondevice/README.md)")
  names = [str(d.get("name", "dev")) if isinstance(d, dict) else "?" for d in doc["devices"]]
  if len(set(names)) != len(names):
    raise ValueError(f"{path}: device names {names} must be unique")
  return {"devices": [spec_from_dict(d) for d in doc["devices"]], "k": doc.get("k", "auto"),
          "windows": doc.get("windows"), "prefetch": bool(doc.get("prefetch", True))}


class EmulatedCache:
  """Chunk-granular page cache of one device over byte ranges of the model file, with an emulated disk.
  Times are emulated seconds. Chunks are LRU (evictable) or pinned (never evicted, count against the
  budget); a ``stream`` access reads what is missing without keeping it (pages faulted in, used once
  and dropped, as a layer that is computed while the next one loads)."""

  def __init__(self, budget_bytes: float, disk_Bps: float, chunk: int = MiB):
    self.budget = budget_bytes
    self.disk_Bps = disk_Bps
    self.chunk = chunk
    self.ready_at: "collections.OrderedDict[int, float]" = collections.OrderedDict()  # chunk -> time, LRU order
    self.pinned: dict = {}  # chunk -> time
    self.disk_free_at = 0.0
    self.bytes_read = 0
    self.evictions = 0

  def _chunks(self, start: int, end: int) -> range:
    return range(start // self.chunk, -(-end // self.chunk))

  def _capacity(self) -> float:
    return self.budget / self.chunk if math.isfinite(self.budget) else math.inf

  def _disk(self, t: float) -> float:
    self.bytes_read += self.chunk
    if not math.isfinite(self.disk_Bps):
      return t
    self.disk_free_at = max(t, self.disk_free_at) + self.chunk / self.disk_Bps
    return self.disk_free_at

  def _read(self, c: int, t: float) -> float:
    done = self._disk(t)
    self.ready_at[c] = done
    self.ready_at.move_to_end(c)
    while self.ready_at and len(self.ready_at) + len(self.pinned) > self._capacity():
      self.ready_at.popitem(last=False)
      self.evictions += 1
    return done

  def prefetch(self, start: int, end: int, t: float) -> None:
    """Asynchronous read-ahead issued at time t (the caller does not wait)."""
    for c in self._chunks(start, end):
      if c in self.pinned:
        continue
      if c in self.ready_at:
        self.ready_at.move_to_end(c)
      else:
        self._read(c, t)

  def access(self, start: int, end: int, t: float, mode: str = "lru") -> float:
    """Touches [start, end) at time t; returns when all of it is in memory (misses read synchronously).
    mode: 'lru' (kept, evictable), 'pin' (kept for good), 'stream' (read through, not kept)."""
    done = t
    for c in self._chunks(start, end):
      r = self.pinned.get(c)
      if r is None:
        r = self.ready_at.get(c)
        if r is None:
          r = self._disk(max(t, done)) if mode == "stream" else self._read(c, max(t, done))
        else:
          self.ready_at.move_to_end(c)
        if mode == "pin":
          self.ready_at.pop(c, None)
          self.pinned[c] = r
      done = max(done, r)
    return done

  def release(self, start: int, end: int) -> None:
    # Only whole chunks inside the range: a chunk shared with a neighbouring window stays.
    for c in range(-(-start // self.chunk), end // self.chunk):
      self.ready_at.pop(c, None)

  def resident_bytes(self) -> int:
    return (len(self.ready_at) + len(self.pinned)) * self.chunk


@dataclasses.dataclass
class Clock:
  """One device's emulated time and what it was spent on."""
  now: float = 0.0
  compute_s: float = 0.0
  disk_wait_s: float = 0.0
  idle_s: float = 0.0

  def as_dict(self) -> dict:
    return {"clock": "emulated", "now_s": self.now, "compute_s": self.compute_s, "disk_wait_s": self.disk_wait_s}


def is_finite_budget(spec: Optional[DeviceSpec]) -> bool:
  return spec is not None and math.isfinite(spec.ram_bytes)
