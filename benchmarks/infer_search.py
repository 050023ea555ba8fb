"""Inference-configuration search on this host (Charon's search case, at CPU scale): enumerate batch x precision x
layer layout for a small KV-cached decode config, predict each one's decode throughput with `perfmodel predict
--mode infer` (cpu profile), then RUN the predicted best and the default for real and compare their speed-ups.

  python -m benchmarks.infer_search [--measure-all] [--out benchmarks/data/infer_search.json]

Candidates: batch in BATCHES x precision (f32: float32 weights and compute; bf16: bfloat16 weights and compute;
the framework has no integer-quantised path, so precision is the quantisation axis) x layers (scan: one scanned
layer body; unrolled: one body per layer). The sampler (framework.sampling.generate) runs on one device, so there
is no device layout to search here. Throughput = batch / TPOT, TPOT the slope of the sampler's time over two
generation lengths (perfmodel.calib.runners.measure_infer_entry, the validation suite's decode measurement).
The default is batch 1, f32, scanned layers (the framework's defaults). The predicted best is chosen among the
candidates whose predicted peak memory fits the profile.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

from benchmarks import provenance
from framework import host_memory
from perfmodel import hardware
from perfmodel.calib import suite
from perfmodel.cost import regime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCHES = (1, 4, 16, 32)
PRECISION = {"f32": dict(dtype="float32", param_dtype="float32"),
             "bf16": dict(dtype="bfloat16", param_dtype="bfloat16")}
LAYERS = {"scan": dict(scan_layers=True), "unrolled": dict(scan_layers=False)}
MODEL = dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=768, max_seq_len=256,
             remat="none")
PROMPT_LEN, GEN_LENS = 32, (8, 56)
DEFAULT = (1, "f32", "scan")


def entry(batch: int, prec: str, layers: str) -> dict:
  return dict(name=f"decode_b{batch}_{prec}_{layers}", batch=batch, prompt_len=PROMPT_LEN, gen_lens=GEN_LENS,
              model={**MODEL, **PRECISION[prec], **LAYERS[layers]})


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--measure-all", action="store_true", help="also run every other candidate for real")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "data", "infer_search.json"))
  a = ap.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # the cpu profile's regime (perfmodel/cli.py _regime), set before jax starts: one pinned core, single-threaded
  # XLA, CPU-time clock, the real job's allocator, so predictions and measurements are in the profile's units
  from perfmodel.cost import trace_nodes  # noqa: PLC0415 (loads jax: after JAX_PLATFORMS, the allocator and the pinning)
  host_memory.apply()
  trace_nodes.enable()
  core = regime.pin(-1)
  from perfmodel import predict, program  # noqa: PLC0415 (loads jax: after JAX_PLATFORMS, the allocator and the pinning)
  from perfmodel.calib import runners  # noqa: PLC0415 (loads jax: after JAX_PLATFORMS, the allocator and the pinning)
  from perfmodel.cost import chain, profiler  # noqa: PLC0415 (loads jax: after JAX_PLATFORMS, the allocator and the pinning)
  hw = hardware.load("cpu")
  profiled = chain.resolve_backend(hw, "auto") in chain.NEEDS_PROFILED_PROGRAM
  rows, t0 = [], time.perf_counter()
  for b, prec, lay in itertools.product(BATCHES, PRECISION, LAYERS):
    e = entry(b, prec, lay)
    cfg, _, _ = runners.entry_cfg(e, suite.BASE)
    cap = program.sampler(cfg, b, PROMPT_LEN, GEN_LENS[1])
    if profiled:  # as `perfmodel predict` and `validate` do: time the program's fusions alone on this host first
      profiler.profile_program(cap.hlo_text, cap.n_devices, hw.name,
                                      stale_before=profiler.stale_before(hw))
    p = predict.predict(cfg, hw, mode="infer", batch=b, prompt_len=PROMPT_LEN, gen_len=GEN_LENS[1], captured=cap)
    rows.append(dict(batch=b, precision=prec, layers=lay, name=e["name"], predicted_tpot_s=p.tpot_s,
                     predicted_tokens_per_s=b / p.tpot_s, predicted_peak_memory_bytes=p.peak_memory_bytes,
                     fits=p.peak_memory_bytes <= hw.mem_bytes))
    print(f"{e['name']:>26}: predicted TPOT {p.tpot_s * 1e3:.3f} ms, {b / p.tpot_s:.0f} tok/s", file=sys.stderr,
          flush=True)
  predict_s = time.perf_counter() - t0
  best = max((r for r in rows if r["fits"]), key=lambda r: r["predicted_tokens_per_s"])
  default = next(r for r in rows if (r["batch"], r["precision"], r["layers"]) == DEFAULT)
  for r in rows:
    if a.measure_all or r is best or r is default:
      cfg, _, _ = runners.entry_cfg(entry(r["batch"], r["precision"], r["layers"]), suite.BASE)
      load0 = os.getloadavg()[0]
      m, _ = runners.measure_infer_entry(cfg, entry(r["batch"], r["precision"], r["layers"]), a.reps)
      r.update(measured_tpot_s=m["measured_s"], measured_noise_pct=m["noise_pct"],
               measured_tokens_per_s=r["batch"] / m["measured_s"], load_avg_1m=[load0, os.getloadavg()[0]],
               tpot_err_pct=100 * (r["predicted_tpot_s"] - m["measured_s"]) / m["measured_s"])
      print(f"{r['name']:>26}: measured TPOT {m['measured_s'] * 1e3:.3f} ms (noise {m['noise_pct']:.1f}%), "
            f"{r['measured_tokens_per_s']:.0f} tok/s, load {r['load_avg_1m']}", file=sys.stderr, flush=True)
  out = {"benchmark": "infer_search", **provenance.stamp("benchmarks.infer_search", argv), "hardware_profile": hw.name,
         "regime": {"pinned_core": core, "clock": "cpu time" if regime.pinned() else "wall",
                    "backend": chain.resolve_backend(hw, "auto")},
         "model": MODEL, "prompt_len": PROMPT_LEN, "gen_lens": list(GEN_LENS), "n_candidates": len(rows),
         "default": default["name"], "best_predicted": best["name"], "predict_wall_s": predict_s,
         "predicted_speedup_pct": 100 * (best["predicted_tokens_per_s"] / default["predicted_tokens_per_s"] - 1),
         "measured_speedup_pct": 100 * (best["measured_tokens_per_s"] / default["measured_tokens_per_s"] - 1),
         "rows": rows}
  measured = [r for r in rows if "measured_tokens_per_s" in r]
  out["best_measured"] = max(measured, key=lambda r: r["measured_tokens_per_s"])["name"]
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)
  print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
