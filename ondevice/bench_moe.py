"""MoE decode under a memory cap: our engine vs llama.cpp on the same MoE GGUF (``python -m ondevice.bench --suite moe``).

Each engine runs in its own spawned process inside its own memory cgroup (cgroup v1 ``memory.limit_in_bytes`` or
v2 ``memory.max``, created under this process's cgroup): the process first loads its libraries and compiles its
kernels on a tiny MoE file, then the limit is set to what the cgroup holds at that point plus ``cap_mb``, so both
engines get the same allowance for the model (page cache and their own buffers; the kernel charges a cgroup's
page cache to it and reclaims it at the limit). The model file is dropped from the page cache first. Then: load,
prefill the prompt, ``n`` greedy tokens, one at a time. Per decode step: wall time, and the bytes the process
read from storage (``/proc/self/io`` read_bytes, i.e. page-cache misses; pages = bytes / 4096) and its major
faults. Ours: ``GGUFLlama`` (MoE blocks in moe.py: only routed experts read, MADV_RANDOM), a repacked-expert
cache of ``expert_cache_mb``. llama.cpp: llama-cpp-python's ``Llama`` (mmap, f32 KV, flash attention off), the
file's mapping as llama.cpp makes it (it asks the kernel to prefetch the whole file at load; no MADV_RANDOM).
Both single-threaded. Without a memory cgroup (not root, no controller) the run says so and uses no cap.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time

import numpy as np


def _own_cgroup() -> tuple:
  """(version, directory of this process's memory cgroup) or (None, why not)."""
  if os.geteuid() != 0:
    return None, "needs root to create a memory cgroup"
  with open("/proc/self/cgroup") as f:
    lines = [ln.strip().split(":", 2) for ln in f if ln.strip()]
  for _, ctl, path in lines:
    if "memory" in ctl.split(","):
      d = "/sys/fs/cgroup/memory" + path
      if os.path.exists(os.path.join(d, "memory.limit_in_bytes")):
        return 1, d
  for hid, ctl, path in lines:
    if hid == "0" and ctl == "":
      d = "/sys/fs/cgroup" + path
      if os.path.exists(os.path.join(d, "cgroup.controllers")) and "memory" in open(
          os.path.join(d, "cgroup.controllers")).read().split():
        return 2, d
  return None, "no memory cgroup controller (v1 memory or v2 memory.max)"


def _cg_files(ver: int) -> tuple:
  return ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes") if ver == 1 else \
      ("memory.max", "memory.current", "memory.peak")


def _io() -> tuple:
  import resource
  with open("/proc/self/io") as f:
    rb = next(int(ln.split(":")[1]) for ln in f if ln.startswith("read_bytes"))
  return rb, resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _child(engine, path, warm, prompt, n, cap_mb, cg, ver, expert_cache_mb, q) -> None:
  try:
    if cg:
      with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    run = _ours if engine == "ours" else _llama
    run(warm, prompt, 4, None, None, 0, expert_cache_mb)  # libraries and kernels in, outside the cap
    cap = None
    if cg and cap_mb is not None:
      lim, cur, _ = _cg_files(ver)
      base = int(open(os.path.join(cg, cur)).read())
      cap = base + int(cap_mb * 2**20)
      with open(os.path.join(cg, lim), "w") as f:
        f.write(str(cap))
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    out = run(path, prompt, n, cg, ver, cap, expert_cache_mb)
    if cg:
      out["cgroup_base_mb"] = None if cap is None else base / 2**20
      out["cgroup_peak_mb"] = int(open(os.path.join(cg, _cg_files(ver)[2])).read()) / 2**20
    q.put(out)
  except Exception as e:  # noqa: BLE001 - one line back to the parent
    q.put({"error": f"{type(e).__name__}: {str(e)[:300]}"})


def _decode(forward_one, first_logits, n) -> dict:
  tok = int(np.argmax(first_logits))
  toks, ts, reads, faults = [tok], [], [], []
  for _ in range(n - 1):
    r0, f0 = _io()
    t0 = time.perf_counter()
    tok = int(np.argmax(forward_one(tok)))
    ts.append(time.perf_counter() - t0)
    r1, f1 = _io()
    reads.append(r1 - r0)
    faults.append(f1 - f0)
    toks.append(tok)
  return {"tokens": toks, "tpot_ms": 1e3 * statistics.median(ts), "tpot_ms_iqr": [
      1e3 * float(np.percentile(ts, 25)), 1e3 * float(np.percentile(ts, 75))],
      "read_mb_per_token": float(np.mean(reads)) / 2**20, "pages_read_per_token": float(np.mean(reads)) / 4096,
      "major_faults_per_token": float(np.mean(faults))}


def _ours(path, prompt, n, cg, ver, cap, expert_cache_mb) -> dict:
  from ondevice.forward import GGUFLlama
  from ondevice.weights import MappedGGUF
  r0, _ = _io()
  t0 = time.perf_counter()
  m = GGUFLlama(MappedGGUF(path), max_len=len(prompt) + n + 8, expert_cache_mb=expert_cache_mb)
  c = m.new_cache()
  first = m.forward(prompt, 0, c, last_only=True)[-1]
  load = {"load_and_prefill_s": time.perf_counter() - t0, "load_and_prefill_read_mb": (_io()[0] - r0) / 2**20}
  pos = [len(prompt)]

  def one(tok):
    out = m.forward([tok], pos[0], c)[-1]
    pos[0] += 1
    return out
  res = _decode(one, first, n)
  ex = m.experts
  total = sum(ex.expert_bytes(i) for i in m.layer_ids)
  return dict(res, **load, **ex.stats(), all_expert_mb=total / 2**20,
              routed_expert_mb_per_token=total * ex.spec.n_used / ex.spec.n_expert / 2**20)


def _llama(path, prompt, n, cg, ver, cap, expert_cache_mb) -> dict:
  import llama_cpp
  r0, _ = _io()
  t0 = time.perf_counter()
  llm = llama_cpp.Llama(path, n_ctx=len(prompt) + n + 8, n_threads=1, n_threads_batch=1, type_k=0, type_v=0,
                        flash_attn=False, logits_all=True, verbose=False)
  llm.eval(prompt)
  first = np.array(llm.scores[llm.n_tokens - 1])
  load = {"load_and_prefill_s": time.perf_counter() - t0, "load_and_prefill_read_mb": (_io()[0] - r0) / 2**20}

  def one(tok):
    llm.eval([tok])
    return llm.scores[llm.n_tokens - 1]
  return dict(_decode(one, first, n), **load, build=llama_cpp.llama_print_system_info().decode().strip())


def run(path: str, prompt: list, n: int, cap_mb: float, expert_cache_mb: float) -> dict:
  from ondevice import testmodels
  from ondevice.gguf_io import read_info
  info = read_info(path)
  if info.moe is None:
    from ondevice.errors import InputError
    raise InputError(f"--suite moe needs a mixture-of-experts file; {path} is dense")
  ver, where = _own_cgroup()
  out = {"clock": "wall", "threads": 1, "file_mb": info.file_size / 2**20, "cap_mb": cap_mb,
         "expert_cache_mb": expert_cache_mb,
         "cap_kind": "none (uncapped run)" if cap_mb is None else
         (f"memory cgroup v{ver}: per engine process, its baseline after loading libraries and "
          f"compiling kernels + {cap_mb} MB") if ver else f"none ({where}): neither engine is capped"}
  work = tempfile.mkdtemp(prefix="ondevice-moe-")
  warm = os.path.join(work, "warm.gguf")
  kind = "qwen3moe" if info.arch == "qwen3moe" else "mixtral"
  qt = sorted({t.qtype for n, t in info.tensors.items() if "_exps" in n})[0].lower()
  testmodels.moe_gguf(warm, kind, qt if qt in ("f16", "q8_0", "q4_0", "f32", "bf16") else "q8_0", n_layers=1,
                      d_model=256, ff=256, n_expert=4)
  spawn = mp.get_context("spawn")
  try:
    for engine in ("ours", "llama_cpp"):
      cg = None
      if ver:
        cg = os.path.join(where, f"ondevice-moe-{os.getpid()}-{engine}")
        os.makedirs(cg, exist_ok=True)
      q = spawn.Queue()
      p = spawn.Process(target=_child, args=(engine, path, warm, prompt, n, cap_mb, cg, ver, expert_cache_mb, q))
      p.start()
      res = None
      while res is None and (p.is_alive() or not q.empty()):
        try:
          res = q.get(timeout=1.0)
        except queue.Empty:
          pass
      if res is None:  # the child died (an OOM kill under the cap, say)
        p.join(timeout=10)
        res = {"error": f"the {engine} process ended without a result (exit code {p.exitcode}; -9: killed, e.g. "
                        f"by the memory cgroup's OOM killer)"}
      p.join(timeout=60)
      if p.exitcode not in (0, None) and "error" not in res:
        res["exit_code"] = p.exitcode
      out[engine] = res
      if cg:
        try:
          os.rmdir(cg)
        except OSError:
          pass
  finally:
    for f in os.listdir(work):
      os.remove(os.path.join(work, f))
    os.rmdir(work)
  a, b = out["ours"], out["llama_cpp"]
  if "tokens" in a and "tokens" in b:
    out["same_greedy_tokens"] = a["tokens"] == b["tokens"]
    out["tpot_ours_over_llama_cpp"] = a["tpot_ms"] / b["tpot_ms"]
    out["read_ours_over_llama_cpp"] = (a["read_mb_per_token"] / b["read_mb_per_token"]
                                       if b["read_mb_per_token"] else None)
  return out
