"""The training step compiled for the target (TPU / GPU compile-only devices), cached by what determines it.

:func:`train_step` returns :func:`perfmodel.program.target_train_step`'s capture, read from
``$PRISMLLM_CACHE/programs/`` when the same program was compiled before: the key hashes the config (every field
that reaches the program), the hardware and topology, the versions of jax, jaxlib, libtpu and the CUDA plugin, and
the framework and parallelism modules the step is built from (``_SOURCES``), so a change to any of them compiles
afresh. An entry is
the optimised HLO text (gzip) and the compiler's memory and timings; re-pricing a cached program parses its text
(seconds) instead of compiling it (minutes for a TPU target on a shared 2-core host).
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from framework import config as config_lib
from framework.config import Config
from parallelism import target_flags, targets
from perfmodel import program
from perfmodel.cost import collectives
from perfmodel.hardware import cache_root

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the code a compiled step is made of (parallelism.step.build_step and what it imports; the GPU descriptions)
_SOURCES = tuple(f"framework/{m}.py" for m in ("config", "model_config", "model", "layers", "rope", "attention",
                                               "remat", "train_step", "optim", "moe", "fp8", "ring_cudnn")) + \
    tuple(f"parallelism/{m}.py" for m in ("step", "jit_step", "shard_map_step", "compiled", "pipeline", "stash",
                                          "schedules", "zero", "manual", "rules", "mesh", "targets")) + \
    ("parallelism/gpu_specs",)
_PACKAGES = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax", "optax")


def cache_dir() -> str:
  return os.path.join(cache_root(), "programs")


def _versions() -> dict:
  out = {}
  for name in _PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _source_digest() -> str:
  h = hashlib.sha256()
  for rel in _SOURCES:
    path = os.path.join(ROOT, rel)
    files = sorted(os.path.join(path, f) for f in os.listdir(path)) if os.path.isdir(path) else [path]
    for f in files:
      with open(f, "rb") as fh:
        h.update(os.path.basename(f).encode() + fh.read())
  return h.hexdigest()[:16]


def key(cfg: Config, hardware: str, topology: Optional[str] = None, framework: Optional[str] = None) -> str:
  """The cache key of ``cfg``'s step compiled for ``hardware`` (with ``framework``'s XLA flags,
  parallelism/target_flags.py): what the program depends on, hashed."""
  d = config_lib.to_dict(cfg)
  d.pop("name", None)
  for section in ("checkpoint", "train"):  # never reach the compiled step
    d.pop(section, None)
  d["data"] = {k: d["data"][k] for k in ("seq_len", "global_batch")}
  k = {"cfg": d, "hw": hardware, "topology": topology, "versions": _versions(), "sources": _source_digest()}
  flags = target_flags.flag_set(hardware, framework).flags
  if flags:  # the compiler's defaults keep the key they always had
    k["flags"] = flags
  blob = json.dumps(k, sort_keys=True, default=str)
  return f"{hardware}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def _load(path: str) -> Optional[program.Captured]:
  try:
    with gzip.open(path, "rt") as f:
      d = json.load(f)
  except (OSError, ValueError, EOFError):
    return None  # absent or half-written by a killed run: compile afresh
  pl = d.pop("placement")
  d["placement"] = collectives.Placement(tuple(tuple(c) for c in pl["coords"]), tuple(pl["shape"]),
                                         tuple(pl["wrap"])) if pl else None
  return program.Captured(**d)


def _store(path: str, cap: program.Captured) -> None:
  d = {f.name: getattr(cap, f.name) for f in dataclasses.fields(cap) if f.name != "compiled"}
  d["placement"] = dataclasses.asdict(cap.placement) if cap.placement is not None else None
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
  try:
    with os.fdopen(fd, "wb") as raw, gzip.open(raw, "wt") as f:
      json.dump(d, f)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def train_step(cfg: Config, hardware: str, topology: Optional[str] = None, cache: bool = True,
               budget_s: Optional[float] = None, framework: Optional[str] = None) -> program.Captured:
  """The target-compiled step of ``cfg`` (cached; ``cache=False`` always compiles and stores nothing), with the XLA
  flags ``framework`` sets for ``hardware`` (parallelism/target_flags.py; None: the compiler's defaults).

  The compile runs in a child process (:func:`_child`) with XLA's dump on. ``budget_s``: once that many seconds
  have passed and the compiler has written the optimised module and its buffer assignment, the child is stopped
  before the rest of code generation (on TPU most of a compile: scheduling and register allocation of every
  kernel) and the program is priced from that module (the same HLO the finished executable holds); its memory is
  then the buffer assignment's (``memory['peak_source']``), not the finished executable's. A cached estimate is
  compiled again when asked without a budget."""
  path = os.path.join(cache_dir(), key(cfg, hardware, topology, framework) + ".json.gz")
  cap = _load(path) if cache else None
  if cap is not None and (budget_s is not None or cap.memory.get("peak_source") != BUFFERS):
    cap.route_detail = (cap.route_detail + "; " if cap.route_detail else "") + f"program read from the cache {path}"
    return cap
  cap = _compile_in_child(cfg, hardware, topology, budget_s, framework)
  if cache:
    _store(path, cap)
  return cap


BUFFERS = "buffer assignment (compile stopped before code generation)"
_HLO, _BUF = "after_optimizations.txt", "after_optimizations-buffer-assignment.txt"


def buffer_memory(text: str) -> dict:
  """Per-chip bytes from a buffer-assignment dump (default memory space): arguments, outputs, donated
  (aliased) bytes and the preallocated temporaries; ``peak`` their live sum (argument + output - alias + temp)."""
  m = dict.fromkeys(("argument", "output", "alias", "temp"), 0)
  for line in text.splitlines():
    a = re.match(r"allocation \d+: size (\d+), (.*)", line)
    if not a or "color" in a.group(2):
      continue
    size, flags = int(a.group(1)), a.group(2)
    m["argument"] += size if "parameter" in flags else 0
    m["output"] += size if "maybe-live-out" in flags else 0
    m["alias"] += size if "parameter" in flags and "maybe-live-out" in flags else 0
    m["temp"] += size if "preallocated-temp" in flags else 0
  m["peak"] = m["argument"] + m["output"] - m["alias"] + m["temp"]
  return dict(m, peak_bytes=m["peak"], temp_size_in_bytes=m["temp"], peak_source=BUFFERS)


def _dumped(folder: str) -> Optional[tuple]:
  """(optimised HLO text, buffer-assignment text) once both are in the dump and complete."""
  names = os.listdir(folder)
  paths = [os.path.join(folder, n) for suffix in (_HLO, _BUF) for n in names if n.endswith(suffix)
           and "train_step" in n][:2]
  if len(paths) < 2 or not paths[0].endswith(_HLO):
    return None
  sizes = [os.path.getsize(x) for x in paths]
  time.sleep(1.0)  # each is written in one go: unchanged for a second = complete
  if [os.path.getsize(x) for x in paths] != sizes:
    return None
  return tuple(open(x).read() for x in paths)


def _compile_in_child(cfg: Config, hardware: str, topology, budget_s, framework=None) -> program.Captured:
  work = tempfile.mkdtemp(prefix="prismllm-compile-")
  dump = os.path.join(work, "dump")
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text").strip()
  spec = {"cfg": config_lib.to_dict(cfg), "hardware": hardware, "topology": topology, "out": work,
          "options": target_flags.compiler_options(target_flags.flag_set(hardware, framework), hardware)}
  t0 = time.perf_counter()
  with open(os.path.join(work, "stderr"), "w") as err:
    child = subprocess.Popen([sys.executable, "-c", "from perfmodel import target; target._child()"],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT,
                             text=True, start_new_session=True)
    child.stdin.write(json.dumps(spec))
    child.stdin.close()
    early, limit, too_big = None, _host_memory_limit(), False
    try:
      while child.poll() is None:
        if _rss(child.pid) > limit:  # stop before the kernel's OOM killer would, and say so
          os.killpg(child.pid, signal.SIGKILL)
          child.wait()
          too_big = True
          break
        if early is None and os.path.isdir(dump):
          early = _dumped(dump)
        if early is not None and budget_s is not None and time.perf_counter() - t0 > budget_s:
          os.killpg(child.pid, signal.SIGKILL)
          child.wait()
          break
        time.sleep(0.5)
    except BaseException:
      os.killpg(child.pid, signal.SIGKILL)
      raise
  if too_big:
    shutil.rmtree(work, ignore_errors=True)
    raise HostMemoryError(f"compiling the step for {hardware} needs more than {limit / 2**30:.1f} GiB of this "
                          f"host's memory (80% of what was available): stopped; free memory or predict on a larger "
                          f"host")
  if early is None and child.returncode != 0 and os.path.isdir(dump):
    early = _dumped(dump)  # the child may have failed between two polls, after writing the program
  try:
    if child.returncode == 0:
      with open(os.path.join(work, "result.json")) as f:
        d = json.load(f)
      detail = ""
    elif early is not None and os.path.exists(os.path.join(work, "placement.json")):
      # stopped by the budget, or the compiler gave up after optimising (on TPU: the program does not fit HBM):
      # either way the optimised program and its buffer assignment are complete
      with open(os.path.join(work, "placement.json")) as f:
        d = json.load(f)
      d.update(hlo_text=early[0], memory=buffer_memory(early[1]), cost_analysis={}, lower_s=0.0,
               compile_s=time.perf_counter() - t0)
      if budget_s is not None and child.returncode < 0:
        detail = (f"compile stopped after {budget_s:.0f} s budget, once XLA had written the optimised program: "
                  f"priced from it; memory from its buffer assignment")
      else:
        d["memory"]["compile_error"] = _last_error(work, child.returncode)
        detail = (f"the compiler stopped after optimising ({d['memory']['compile_error'][:160]}): priced from the "
                  f"optimised program; memory from its buffer assignment")
    else:
      raise RuntimeError(f"compiling the step for {hardware} failed: {_last_error(work, child.returncode)}")
  finally:
    shutil.rmtree(work, ignore_errors=True)
  pl = d.pop("placement")
  return program.Captured(placement=collectives.Placement(tuple(tuple(c) for c in pl["coords"]), tuple(pl["shape"]),
                                                          tuple(pl["wrap"])), route_detail=detail, **d)


class HostMemoryError(MemoryError):
  """The compile would not fit this host's memory."""


def _host_memory_limit() -> int:
  """80% of the memory available now (MemAvailable), the most a compile child may take."""
  with open("/proc/meminfo") as f:
    info = dict(line.split(":", 1) for line in f)
  return int(0.8 * int(info["MemAvailable"].split()[0]) * 1024)


def _rss(pid: int) -> int:
  """Resident bytes of a process (0 once it is gone)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
  except (OSError, StopIteration):
    return 0


def _last_error(work: str, returncode: int) -> str:
  """The child's last error line (XLA's status message when there is one)."""
  with open(os.path.join(work, "stderr")) as f:
    lines = [x for x in f.read().splitlines() if x.strip()]
  errs = [x for x in lines if re.search(r"(Error|RESOURCE_EXHAUSTED|INTERNAL|INVALID_ARGUMENT)", x)]
  return ((errs or lines)[-1:] or [f"exit {returncode}"])[0][:400]


def _child() -> None:
  """The compile of :func:`_compile_in_child`: spec on stdin; writes placement.json first, result.json at the end."""
  spec = json.loads(sys.stdin.read())
  cfg = config_lib.from_dict(spec["cfg"])
  mesh = targets.target_mesh(cfg.mesh, spec["hardware"], spec["topology"])
  pl = dataclasses.asdict(program.placement(mesh, spec["hardware"], spec["topology"]))
  with open(os.path.join(spec["out"], "placement.json"), "w") as f:
    json.dump({"placement": pl, "n_devices": mesh.size}, f)
  cap = program.target_train_step(cfg, spec["hardware"], spec["topology"], compiler_options=spec["options"])
  d = {f.name: getattr(cap, f.name) for f in dataclasses.fields(cap) if f.name not in ("compiled", "route_detail")}
  d["placement"] = pl
  with open(os.path.join(spec["out"], "result.json"), "w") as f:
    json.dump(d, f)
