"""Halda's predicted TPOT against a ring that really reads its weights from files (``--suite halda-real``).

What is real here: every device is a process with its OWN copy of the GGUF file (so page caches are separate,
as on separate machines), mmap'd; the kernels compute on the file's pages (``repack=False``); at start a
device drops its file from the page cache; Halda's residency is executed with madvise/fadvise (pinned bytes
read once and kept, the prefetch buffer read ahead with MADV_WILLNEED while the rest of the ring works and
dropped after use, the streamed part read when its window runs and dropped after); and each device's reads
go through the kernel's block-I/O throttle (a cgroup-v1 blkio ``throttle.read_bps_device`` or cgroup-v2
``io.max`` per device), a mechanism independent of Halda's cost model. Times are wall clock.

Runs: each device alone with Halda's residency (k = 1: pin what fits, stream the rest), and the ring at k = 1
and k = auto. Halda is given measured numbers only: each device's disk throughput read back through its throttle
(profiler.disk_read inside its cgroup), the per-layer compute time of the kernels the devices run, and the
localhost link. Reported: Halda's TPOT vs the measured one, and the disk MB per token it predicts vs what the
devices' /proc/<pid>/io read_bytes counted, whatever the errors are. The RAM budget is not enforced by the
kernel (that needs a memory cgroup per device); each device's resident bytes of its file (mincore) are reported.
Needs root and a blkio/io controller; otherwise one error line says so.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile

CG_V1 = "/sys/fs/cgroup/blkio"
CG_V2 = "/sys/fs/cgroup"


def _disk_of(path: str) -> str:
  """'major:minor' of the whole disk holding ``path`` (throttles apply to disks, not partitions)."""
  st = os.stat(path).st_dev
  mm = f"{os.major(st)}:{os.minor(st)}"
  sysd = f"/sys/dev/block/{mm}"
  if os.path.exists(os.path.join(sysd, "partition")):
    with open(os.path.join(os.path.realpath(sysd), "..", "dev")) as f:
      mm = f.read().strip()
  return mm


def throttle_available() -> str:
  """'' if per-device disk throttling can be set up here, else why not (one line)."""
  if os.geteuid() != 0:
    return "needs root to create blkio/io cgroups"
  if os.path.exists(os.path.join(CG_V1, "blkio.throttle.read_bps_device")):
    return ""
  ctl = os.path.join(CG_V2, "cgroup.controllers")
  if os.path.exists(ctl) and "io" in open(ctl).read().split():
    return ""
  return "no cgroup blkio (v1) or io (v2) controller to throttle reads"


def make_cgroups(tag: str, rates_Bps: list, disk: str) -> list:
  dirs = []
  v1 = os.path.exists(os.path.join(CG_V1, "blkio.throttle.read_bps_device"))
  for i, r in enumerate(rates_Bps):
    d = os.path.join(CG_V1 if v1 else CG_V2, f"ondevice-{tag}-{i}")
    os.makedirs(d, exist_ok=True)
    if v1:
      with open(os.path.join(d, "blkio.throttle.read_bps_device"), "w") as f:
        f.write(f"{disk} {int(r)}")
    else:
      with open(os.path.join(d, "io.max"), "w") as f:
        f.write(f"{disk} rbps={int(r)}")
    dirs.append(d)
  return dirs


def remove_cgroups(dirs: list) -> None:
  for d in dirs:
    try:
      os.rmdir(d)
    except OSError:
      pass


def _measure_disk(path: str, cgroup: str, q) -> None:
  with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
  from ondevice.profiler import disk_read
  import statistics
  import time
  n = min(16 << 20, os.path.getsize(path))
  rates = []
  for _ in range(4):  # the median of passes 2-4: the first spends the throttle's burst allowance
    rates.append(disk_read(path, n))
    time.sleep(0.2)
  q.put(statistics.median(rates[1:]))


def _run_ring(path, windows, specs, opts, n_gpu, residency, prompt, n, q) -> None:
  from ondevice import generate
  from ondevice.ring import RingEngine
  try:
    with RingEngine(path, windows, specs, opts, n_gpu=n_gpu, residency=residency) as eng:
      first = generate.greedy(eng, prompt, 2)  # prefill + pinned reads + the first tokens (cold start)
      before = eng.stats()
      st = generate.greedy(eng, prompt + first.tokens, n)
      after = eng.stats()
    q.put({"tpot_ms": 1e3 * st.tpot_s, "tokens": st.tokens,
           "read_mb_per_token": sum(a["real_read_bytes"] - b["real_read_bytes"] for a, b in zip(after, before))
           / 2**20 / max(1, n + 1), "resident_mb_end": [round(a["resident_mb"], 3) for a in after]})
  except Exception as e:  # noqa: BLE001 - reported to the parent as one line
    q.put({"error": f"{type(e).__name__}: {e}"})


def run(path: str, devices: str, n: int, prompt: list, ks=(1, "auto")) -> dict:
  from ondevice import planner, profiler
  from ondevice.device import DeviceOptions
  from ondevice.emulation import DeviceSpec, load_devices
  from ondevice.errors import InputError
  from ondevice.gguf_io import read_info
  why = throttle_available()
  if why:
    raise InputError(f"--suite halda-real {why}; run it as root on Linux with cgroups, or use --suite ring")
  info = read_info(path)
  given = load_devices(devices)["devices"]
  ctx = len(prompt) + n + 16
  work = tempfile.mkdtemp(prefix="ondevice-realio-", dir=os.path.dirname(os.path.abspath(path)))
  spawn = mp.get_context("spawn")
  cgs = []
  out = {"clock": "wall", "mechanism": "kernel blkio throttle per device process, own file copy each, real "
         "mmap + madvise/fadvise", "devices_given": [{"name": s.name, "ram_mb": s.ram_bytes / 2**20,
                                                     "throttle_mbps": s.disk_Bps / 2**20} for s in given]}
  try:
    copies = []
    for i in range(len(given)):
      copies.append(os.path.join(work, f"rank{i}.gguf"))
      shutil.copyfile(path, copies[-1])
      with open(copies[-1], "rb+") as f:
        os.fsync(f.fileno())  # written back, so that dropping its pages really empties the cache
    cgs = make_cgroups(f"{os.getpid()}", [s.disk_Bps for s in given], _disk_of(work))
    measured = []
    for c, g in zip(copies, cgs):
      q = spawn.Queue()
      p = spawn.Process(target=_measure_disk, args=(c, g, q))
      p.start()
      measured.append(q.get(timeout=600))
      p.join()
    layer_s, head_s = profiler.layer_time(path, repack=False), profiler.head_time(path, repack=False)
    link = profiler.link(nbytes=info.cfg.d_model * 4)
    specs = [DeviceSpec(s.name, s.ram_bytes, measured[i], 1.0, link_Bps=link["link_Bps"],
                        link_latency_s=link["link_latency_s"]) for i, s in enumerate(given)]
    out.update(measured_disk_mbps=[round(v / 2**20, 3) for v in measured], measured_layer_ms=1e3 * layer_s,
               measured_head_ms=1e3 * head_s, measured_link_ms=1e3 * link["link_latency_s"])
    runs = [(f"alone_{s.name}_halda_k1", [s], 1) for s in specs] + [(f"ring_halda_k{k}", specs, k) for k in ks]
    for name, subset, k in runs:
      p, kept = planner.plan(info, subset, "halda", k, layer_s, head_s, ctx)
      ranks = [next(i for i, s in enumerate(specs) if s.name == kp.name) for kp in kept]
      opts = DeviceOptions(prefetch=True, policy="plan", real_io=True, max_len=ctx,
                           rank_paths=tuple(copies[r] for r in ranks), blkio_cgroups=tuple(cgs[r] for r in ranks))
      q = spawn.Queue()
      proc = spawn.Process(target=_run_ring, args=(path, p.windows, kept, opts, p.n_gpu, p.residency, prompt, n, q))
      proc.start()
      res = q.get(timeout=3600)
      proc.join()
      row = dict(p.as_dict(), devices=[s.name for s in kept], **res)
      if "tpot_ms" in res:
        row["tpot_error_pct"] = 100 * (res["tpot_ms"] - row["halda_model_latency_ms"]) / row["halda_model_latency_ms"]
        row["disk_mb_per_token_error_pct"] = 100 * (res["read_mb_per_token"] - row["halda_model_disk_mb_per_token"]) \
            / max(1e-9, row["halda_model_disk_mb_per_token"])
      out[name] = row
  finally:
    remove_cgroups(cgs)
    shutil.rmtree(work, ignore_errors=True)
  return out
