"""The ring suite of ``python -m ondevice.bench``: Halda's pipelined ring against fair baselines, emulated clock.

Every scenario runs the same model and prompt on emulated devices (emulation.py: real compute x cpu_slowdown,
a page-granular LRU page cache in front of a throughput-limited disk, link latency + bandwidth), measured the
same way (``generate.greedy``, TPOT on the emulated clock):
* ``alone_<device>``: the whole model on that one device, mmap'd, the OS's LRU page cache, no read-ahead:
  how llama.cpp runs a model larger than RAM. The fastest of these is THE single-device baseline;
* ``best_alone_halda_k1``: that best device with Halda's residency (pin what fits, stream the rest);
* ``exo_like_memory_split``: layers proportional to RAM, one window each (k = 1), LRU mmap (exo);
* ``equal_layers_split``: equal layers per device, k = 1, LRU mmap;
* ``dllama_like_tensor_parallel``: every layer split equally over the devices, two syncs per layer
  (baselines.py; distributed-llama is tensor-parallel, so this, not equal layers, is the closer model);
* ``prima_runtime_k1`` / ``prima_runtime_kauto`` (with ``--scenarios all``): Halda's windows under prima.cpp's
  runtime (whole next window read ahead, LRU);
* ``halda_k1`` and ``halda_ring`` (k = auto): ours. Halda's predicted TPOT is reported beside each; on this
  clock the emulator implements the model's assumptions, so agreement here checks the implementation, not the
  model (``--suite halda-real`` checks it against real reads).
With ``--draft``: speculative decoding on the Halda ring over prompts cut from the Python standard library's
source (what ondevice_spec.py's pair is trained on), acceptance and speed-up per prompt.
"""
from __future__ import annotations

import inspect
import os


def stdlib_prompts(n: int = 4, length: int = 160) -> list:
  """Real Python source: ``length`` bytes from the first ``def`` after 2 KB of a few stdlib modules."""
  import argparse
  import functools
  import json.decoder
  import textwrap
  out = []
  for mod in (textwrap, functools, json.decoder, argparse)[:n]:
    src = inspect.getsource(mod)
    i = src.find("\ndef ", 2000)
    i = src.find("\n    def ", 2000) if i < 0 else i
    out.append(src[i + 1:i + 1 + length].encode())
  return [list(p) for p in out]


def _row(p, policy, pf, st, stats, n):
  return dict(p.as_dict(), policy=policy, prefetch=pf, **st.as_dict(),
              disk_read_mb_per_token=sum(s.get("emulated_disk_read_mb", 0) for s in stats) / max(1, n),
              pressure=[round((s.get("emulated_resident_mb", 0) + s.get("kv_mb", 0)) / s["budget_mb"], 3)
                        if s.get("budget_mb") else None for s in stats])


def run(path: str, devices: str, n: int, prompt: list, draft: str = None, gamma: int = 4, extra: tuple = ()) -> dict:
  from ondevice import generate, planner, profiler
  from ondevice.baselines import TensorParallelEmulation
  from ondevice.device import DeviceOptions
  from ondevice.emulation import load_devices
  from ondevice.gguf_io import read_info
  from ondevice.ring import RingEngine
  info = read_info(path)
  specs = load_devices(devices)["devices"]
  layer_s, head_s = profiler.layer_time(path), profiler.head_time(path)
  ctx = len(prompt) + n + 8
  chunk = 4096  # one page: the emulated page cache is exact at page granularity
  out = {"clock": "emulated", "measured_layer_ms": 1e3 * layer_s, "chunk_bytes": chunk, "prompt_tokens": len(prompt)}
  ref = None

  def ring(name, p, kept, policy, pf):
    nonlocal ref
    opts = DeviceOptions(prefetch=pf, policy=policy, chunk_bytes=chunk, max_len=ctx)
    res = p.residency if policy == "plan" else None
    with RingEngine(path, p.windows, kept, opts, n_gpu=p.n_gpu, residency=res) as eng:
      st = generate.greedy(eng, prompt, n)
      out[name] = _row(p, policy, pf, st, eng.stats(), n)
      out[name]["devices"] = [s.name for s in kept]
    ref = ref or st.tokens
    out[name]["same_tokens"] = st.tokens == ref
    return out[name]

  for m, s in enumerate(specs):  # every device alone, llama.cpp-style mmap
    p, kept = planner.plan(info, [s], "single", 1, layer_s, head_s, ctx)
    ring(f"alone_{s.name}", p, kept, "os", False)
  best = min(specs, key=lambda s: out[f"alone_{s.name}"]["tpot_ms"])
  out["best_single_device"] = best.name
  p, kept = planner.plan(info, [best], "halda", 1, layer_s, head_s, ctx)
  ring("best_alone_halda_k1", p, kept, "plan", True)
  for name, method in (("exo_like_memory_split", "memory"), ("equal_layers_split", "equal")):
    p, kept = planner.plan(info, specs, method, 1, layer_s, head_s, ctx)
    ring(name, p, kept, "os", False)
  M = 1 << (min(len(specs), info.cfg.n_kv_heads).bit_length() - 1)  # dllama: 2^n nodes, <= KV heads
  with TensorParallelEmulation(path, specs[:M], ctx, chunk) as tp:
    st = generate.greedy(tp, prompt, n)
    disk = sum(s["emulated_disk_read_mb"] for s in tp.stats()) / n
    out["dllama_like_tensor_parallel"] = dict(st.as_dict(), devices=[s.name for s in specs[:M]],
                                              disk_read_mb_per_token=disk, same_tokens=st.tokens == ref)
  scen = [("halda_k1", 1, "plan", True), ("halda_ring", "auto", "plan", True)]
  if "all" in extra or "prima" in extra:
    scen = [("prima_runtime_k1", 1, "os", True), ("prima_runtime_kauto", "auto", "os", True)] + scen
  for name, k, policy, pf in scen:
    p, kept = planner.plan(info, specs, "halda", k, layer_s, head_s, ctx)
    row = ring(name, p, kept, policy, pf)
    if policy == "plan":
      model = row["halda_model_latency_ms"]
      row["halda_model_error_pct"] = 100 * (row["tpot_ms"] - model) / model
    if draft and name == "halda_ring":
      out["speculative"] = speculative_on_ring(path, draft, p, kept, ctx, gamma, chunk)
  t = out["halda_ring"]["tpot_ms"]
  out["speedup_vs_best_single_device"] = out[f"alone_{best.name}"]["tpot_ms"] / t
  out["speedup_vs_best_single_device_halda"] = out["best_alone_halda_k1"]["tpot_ms"] / t
  out["speedup_vs_exo_like"] = out["exo_like_memory_split"]["tpot_ms"] / t
  out["speedup_vs_equal_layers"] = out["equal_layers_split"]["tpot_ms"] / t
  out["speedup_vs_dllama_like"] = out["dllama_like_tensor_parallel"]["tpot_ms"] / t
  return out


def speculative_on_ring(path: str, draft: str, p, kept, ctx: int, gamma: int, chunk: int, n: int = 48) -> dict:
  """Greedy vs speculative decoding on the Halda ring, per stdlib prompt; the draft runs on the head."""
  from ondevice import generate
  from ondevice.device import DeviceOptions
  from ondevice.forward import GGUFLlama
  from ondevice.ring import RingEngine
  from ondevice.weights import MappedGGUF
  if os.path.samefile(path, draft):
    raise ValueError("--draft is the target file itself; pass a smaller draft model")
  prompts = stdlib_prompts()
  ctx = max(ctx, max(len(q) for q in prompts) + n + gamma + 8)
  opts = DeviceOptions(prefetch=True, policy="plan", chunk_bytes=chunk, max_len=ctx)
  dm = GGUFLlama(MappedGGUF(draft), max_len=ctx)
  rows = []
  for q in prompts:
    with RingEngine(path, p.windows, kept, opts, n_gpu=p.n_gpu, residency=p.residency) as eng:
      g = generate.greedy(eng, q, n)
    with RingEngine(path, p.windows, kept, opts, n_gpu=p.n_gpu, residency=p.residency) as eng:
      dm.forward(q[:gamma + 1], 0, dm.new_cache())  # compile the draft's kernels outside the clock
      s = generate.speculative(eng, generate.Draft(dm, eng), q, n, gamma)
    rows.append({"prompt": bytes(q[:40]).decode("utf-8", "replace"), "acceptance": s.accepted / max(1, s.drafted),
                 "speedup": g.decode_s / s.decode_s, "identical_to_greedy": s.tokens == g.tokens,
                 "greedy_text": bytes(t for t in g.tokens if t < 256).decode("utf-8", "replace")[:60]})
  acc = [r["acceptance"] for r in rows]
  sp = [r["speedup"] for r in rows]
  return {"gamma": gamma, "tokens_per_prompt": n, "draft": os.path.basename(draft), "target": os.path.basename(path),
          "mean_acceptance": sum(acc) / len(acc), "speedup_per_prompt": [round(v, 3) for v in sp],
          "mean_speedup": sum(sp) / len(sp), "all_identical_to_greedy": all(r["identical_to_greedy"] for r in rows),
          "per_prompt": rows}
