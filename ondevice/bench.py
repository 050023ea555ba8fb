"""python -m ondevice.bench --model m.gguf --suite single [--tokens 32]
   python -m ondevice.bench --suite kernels
   python -m ondevice.bench --model m.gguf --suite ring --devices devices.yaml [--draft d.gguf]
   python -m ondevice.bench --model m.gguf --suite halda-real --devices benchmarks/ondevice_devices_real.yaml
   python -m ondevice.bench --model moe.gguf --suite moe --tokens 32 --cap-mb 24 [--expert-cache-mb 8]

Prints one JSON object; --record also writes it, with the command, machine and date, to the committed
benchmarks/data/ondevice_bench_<suite>.json.
single: TPOT / prefill of our engine vs llama.cpp (exact and default configurations) on the same file, the
        same token stream and 1 and 2 threads (bench_single.py), and a jitted JAX f32 decode step
        (framework.model on the file's dequantised weights; --no-jax skips it).
halda-real: Halda's predicted TPOT vs a ring that really reads its files through kernel-throttled disks
        (realio.py; wall clock; needs root and cgroups).
kernels: one 2816x1024 mat-vec per kernel (mmap layout, planes hot/streamed/4 tokens, F16, F32 BLAS).
moe:    a mixture-of-experts file under a memory cap (a memory cgroup per engine process, the same allowance for
        both): TPOT and pages read from storage per token, ours vs llama.cpp (bench_moe.py).
ring:   emulated devices (labelled "clock": "emulated"): every device alone (the best one is the baseline),
        exo-like, equal-layers and dllama-like tensor-parallel splits, Halda's ring, and speculative decoding on
        stdlib text (bench_ring.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy as np


def _median_ms(ts):
  return 1e3 * statistics.median(ts) if ts else None


def _iqr_ms(ts):
  return [1e3 * float(np.percentile(ts, 25)), 1e3 * float(np.percentile(ts, 75))]


def bench_jax(path: str, prompt: list, n: int) -> dict:
  import jax
  import jax.numpy as jnp
  from framework import model as fm
  from ondevice.gguf_io import load_params
  params, cfg = load_params(path)
  params = jax.device_put(params)  # once: numpy args would be copied to the device on every call
  model = fm.build(cfg)
  L = len(prompt) + n + 8
  with jax.numpy_rank_promotion("allow"):
    step = jax.jit(lambda p, t, pos, kv, i: model.apply({"params": p}, t, pos, kv, i))
    kv = fm.init_kv_cache(cfg, 1, L)
    toks = jnp.asarray([prompt])
    logits, kv = step(params, toks, jnp.arange(len(prompt))[None], kv, 0)
    ts, pos = [], len(prompt)
    tok = int(jnp.argmax(logits[0, -1]))
    for i in range(n + 1):
      t0 = time.perf_counter()
      logits, kv = step(params, jnp.asarray([[tok]]), jnp.asarray([[pos]]), kv, pos)
      tok = int(jnp.argmax(logits[0, -1]))
      if i:  # first call compiles
        ts.append(time.perf_counter() - t0)
      pos += 1
  return {"tpot_ms": _median_ms(ts)}




def bench_spec(path: str, draft: str, n: int, gammas=(2, 3, 4, 6)) -> dict:
  """Local device (wall clock): plain greedy vs speculative decoding with a draft model, several prompts.
  Reports tokens/s of each, the acceptance rate, and whether the output is identical (it must be)."""
  from ondevice import generate
  from ondevice.forward import GGUFLlama
  from ondevice.ring import RingEngine
  from ondevice.weights import MappedGGUF
  from ondevice.bench_ring import stdlib_prompts
  prompts = stdlib_prompts()
  out = {"clock": "wall", "prompts": "stdlib source (bench_ring.stdlib_prompts)", "tokens_per_prompt": n}
  with RingEngine(path, [[list(range(_n_layers(path)))]], [None]) as eng:
    generate.greedy(eng, list(b"warm up"), 4)  # compile kernels outside the timing
    dm = GGUFLlama(MappedGGUF(draft), max_len=eng.head.model.max_len)
    generate.Draft(dm, eng).propose(list(b"warm up"), 2)
    plain_s, plain_tok, ref = 0.0, 0, []
    for pr in prompts:
      eng.head.cache = eng.head.model.new_cache()
      st = generate.greedy(eng, pr, n)
      plain_s += st.decode_s
      plain_tok += len(st.tokens) - 1
      ref.append(st.tokens)
    out["greedy_tokens_per_s"] = plain_tok / plain_s
    for g in gammas:
      sp_s, sp_tok, drafted, accepted, same = 0.0, 0, 0, 0, True
      for pr, r in zip(prompts, ref):
        eng.head.cache = eng.head.model.new_cache()
        st = generate.speculative(eng, generate.Draft(dm, eng), pr, n, g)
        sp_s += st.decode_s
        sp_tok += len(st.tokens) - 1
        drafted, accepted = drafted + st.drafted, accepted + st.accepted
        same = same and st.tokens == r
      out[f"gamma{g}"] = {"tokens_per_s": sp_tok / sp_s, "speedup": (sp_tok / sp_s) / out["greedy_tokens_per_s"],
                          "acceptance": accepted / max(1, drafted), "identical_to_greedy": same}
  out["sample"] = bytes(ref[0]).decode("utf-8", "replace")
  return out


def bench_kernels(n_out: int = 2816, n_in: int = 1024, copies: int = 40, reps: int = 20) -> dict:
  """One n_out x n_in mat-vec (the big model's FFN shape), 1 thread, median ms. "hot": the same matrix
  every call (stays in L2); "streamed": cycling through `copies` distinct matrices (~70 MB: from L3 /
  memory, as in a decode step). planes_T4: 4 tokens in one call (a speculative verify pass)."""
  import gguf
  from ondevice import kernels, planes
  rng = np.random.default_rng(0)
  w = rng.normal(size=(n_out, n_in)).astype(np.float32)
  x1, x4 = rng.normal(size=(1, n_in)).astype(np.float32), rng.normal(size=(4, n_in)).astype(np.float32)

  def med(f, n=reps):
    f()
    ts = []
    for _ in range(n):
      t0 = time.perf_counter()
      f()
      ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)

  out = {"shape": [n_out, n_in], "threads": 1}
  for qt in ("Q4_0", "Q8_0"):
    raw = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, qt))
    ps = [planes.repack(qt, [raw ^ np.uint8(i)], n_in) for i in range(copies)]
    out[qt] = {"mmap_layout_ms": med(lambda: kernels.matmul(qt, raw, x1, n_out, n_in)),
               "planes_hot_ms": med(lambda: ps[0](x1)),
               "planes_streamed_ms": med(lambda: [p(x1) for p in ps], 5) / copies,
               "planes_T4_streamed_ms": med(lambda: [p(x4) for p in ps], 5) / copies}
    asm = planes.inspect_asm(qt)
    out[qt]["vector_code"] = ("vpdpbusd zmm" if "vpdpbusd" in asm and "zmm" in asm else
                              "zmm" if "zmm" in asm else "ymm" if "ymm" in asm else "none")
  w16 = w.astype(np.float16)
  out["F16_ms"] = med(lambda: kernels.matmul("F16", w16, x1, n_out, n_in))
  out["F32_blas_ms"] = med(lambda: kernels.matmul("F32", w, x1, n_out, n_in))
  return out


def _n_layers(path: str) -> int:
  from ondevice.gguf_io import read_info
  return read_info(path).cfg.n_layers


RECORD_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "data")


def record(suite: str, cmd: str, result: dict, path: str = None) -> str:
  """Writes the committed data file of this suite, ``benchmarks/data/ondevice_bench_<suite>.json``: the result
  with the command, machine and date (``python -m benchmarks.results`` renders it into benchmarks/RESULTS.md)."""
  path = path or os.path.join(RECORD_DIR, f"ondevice_bench_{suite.replace('-', '_')}.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  out = {"date": datetime.datetime.now().isoformat(timespec="minutes"), "command": cmd,
         "machine": f"{platform.machine()} {os.cpu_count()} cores", "result": result}
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  return path


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m ondevice.bench", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default=None, help="GGUF file (all suites but kernels)")
  ap.add_argument("--suite", default="single", choices=["single", "ring", "halda-real", "spec", "kernels", "moe"])
  ap.add_argument("--devices", default=None)
  ap.add_argument("--draft", default=None)
  ap.add_argument("--gamma", type=int, default=4, help="ring: draft length")
  ap.add_argument("--gammas", default="2,3,4,6", help="spec: draft lengths to sweep")
  ap.add_argument("--tokens", type=int, default=32)
  ap.add_argument("--prompt", default="def fibonacci(n):\n    ")
  ap.add_argument("--threads", default="1,2", help="single: thread counts to compare (ours and llama.cpp alike)")
  ap.add_argument("--rounds", type=int, default=3, help="single: repetitions of the paired stream (noise floor)")
  ap.add_argument("--no-jax", action="store_true")
  ap.add_argument("--cap-mb", type=float, default=24.0, help="moe: memory allowance per engine (memory cgroup)")
  ap.add_argument("--expert-cache-mb", type=float, default=8.0, help="moe: our repacked-expert cache")
  ap.add_argument("--uncapped-too", action="store_true", help="moe: also run both engines with no cap")
  ap.add_argument("--record", action="store_true",
                  help="write this run to the committed benchmarks/data/ondevice_bench_<suite>.json")
  ap.add_argument("--scenarios", default="", help="ring: 'all' adds prima.cpp's runtime on Halda's windows")
  args = ap.parse_args(argv)
  from ondevice.gguf_io import describe, read_info
  prompt = list(args.prompt.encode())
  if args.suite != "kernels" and not args.model:
    ap.error(f"--suite {args.suite} needs --model")
  if args.draft and os.path.exists(args.draft) and os.path.samefile(args.draft, args.model):
    ap.error("--draft is the target file itself (acceptance 1 by construction); pass a smaller draft model")
  res = {"model": describe(read_info(args.model)) if args.model else None, "threads": args.threads,
         "tokens": args.tokens, "load_avg": os.getloadavg()[0]}
  if args.suite == "kernels":
    res["kernels"] = bench_kernels()
  elif args.suite == "single":
    from ondevice import bench_single
    from ondevice.peer import PeerCrash
    threads = tuple(int(t) for t in str(args.threads).split(","))
    try:
      res.update(bench_single.run(args.model, prompt, args.tokens, threads, args.rounds))
    except PeerCrash as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    res["jax_f32"] = {"skipped": "--no-jax"} if args.no_jax else bench_jax(args.model, prompt, args.tokens)
  elif args.suite == "moe":
    from ondevice import bench_moe
    res["moe"] = bench_moe.run(args.model, prompt, args.tokens, args.cap_mb, args.expert_cache_mb)
    if args.uncapped_too:  # the same file with no cap and an unbounded expert cache
      res["moe_uncapped"] = bench_moe.run(args.model, prompt, args.tokens, None, None)
  elif args.suite == "spec":
    if not args.draft:
      ap.error("--suite spec needs --draft")
    gammas = tuple(int(g) for g in args.gammas.split(","))
    res["spec"] = bench_spec(args.model, args.draft, args.tokens, gammas)
  elif args.suite == "halda-real":
    if not args.devices:
      ap.error("--suite halda-real needs --devices (e.g. benchmarks/ondevice_devices_real.yaml)")
    from ondevice import realio
    from ondevice.errors import InputError
    try:
      res["halda_real"] = realio.run(args.model, args.devices, args.tokens, prompt)
    except InputError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
  else:
    if not args.devices:
      ap.error("--suite ring needs --devices")
    from ondevice import bench_ring
    res["ring"] = bench_ring.run(args.model, args.devices, args.tokens, prompt, args.draft, args.gamma,
                                 tuple(x for x in args.scenarios.split(",") if x))
  print(json.dumps(res))
  if args.record:
    record(args.suite, "python -m ondevice.bench " + " ".join(argv if argv is not None else sys.argv[1:]), res)
  return 0


if __name__ == "__main__":
  sys.exit(main())
