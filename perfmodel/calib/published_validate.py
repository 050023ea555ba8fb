"""`python -m perfmodel validate --published`: every included published training row through ``predict``.

Each row (perfmodel/calib/published.py) becomes the command line of the predict contract,
``python -m perfmodel predict --config experiments/configs/llama3_70b.py --hardware H [--topology T]
--config.model.*=... --config.data.*=... --config.mesh.*=...``, run in a child process (a compiler abort or a
memory blow-up costs one row, not the run); the child compiles the step for the target (``target_compile``, its
program cached in ``$PRISMLLM_CACHE/programs/``, so a re-run only re-prices) and prints its Prediction. Nothing is
fitted: the rows only score the model.

How a row becomes a PrismLLM config (``row_config``), each choice listed in the row's ``mapping``:
  * architecture: the row's widths, head_dim, MLP kind, tied embedding; ``model.block=parallel`` for MaxText's 2023
    parallel block; biases and learned positions are left out (under 0.1% of the FLOPs of these models);
  * layout: dp/fsdp/tp/pp/cp -> mesh data/fsdp/tensor/pipeline/sequence; pipelined rows run PrismLLM's
    non-interleaved 1F1B (an interleaved schedule's virtual stages have no equivalent: its smaller bubble is not
    modelled); a row published on k TPU slices compiles for k slices of its per-slice shape;
  * attention: ``splash`` on TPU (MaxText ran its flash kernel), ``blockwise`` on TPU where the layout forbids
    splash (pipeline stages, context parallelism); ``cudnn`` on GPU (cuDNN flash attention), XLA's
    ``dot_product`` with context parallelism (masked by the tokens' positions);
  * recompute: the row's policy, or ``minimal`` (matmul outputs kept, the attention core recomputed: Megatron's
    selective recomputation, its default) where none is published;
  * micro-batches: ``mesh.microbatches``: pipeline micro-batches on pipelined rows, gradient accumulation steps
    on the others (one micro-batch's activations live at a time, as in MaxText and Megatron);
  * precision: bf16 compute, f32 master weights and AdamW moments; fp16 rows run as bf16 and are scored apart.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from typing import Optional

from perfmodel.calib import published as P

ROOT = P.ROOT
BASE_CONFIG = P.BASE_CONFIG
TIMEOUT_S = 3600


def _slices(r: P.PublishedRun) -> int:
  m = re.search(r"across (\d+) slice", r.notes)
  return int(m.group(1)) if m else 1


def row_config(r: P.PublishedRun) -> tuple:
  """(override strings, topology or None, mapping notes) of a row: module docstring."""
  from parallelism import targets  # noqa: PLC0415 (planning only: no compiler is loaded)
  tpu = r.hardware.startswith("tpu")
  notes = []
  pipelined, cp = r.pipeline > 1, r.sequence > 1
  if tpu and not pipelined and not cp and r.seq_len % 128 == 0:
    attention = "splash"
  elif not tpu and not cp and r.head_dim <= 128 and r.head_dim % 8 == 0:
    attention = "cudnn"
  elif not tpu and not cp:
    attention = "dot_product"
    notes.append(f"attention dot_product (XLA): head dim {r.head_dim} is outside cuDNN flash attention's (<= 128)")
  elif not tpu:
    # cuDNN's kernel with a position mask (context parallelism) compiles into a host literal of tens of GB under
    # gradient accumulation: XLA's own attention, masked by the positions, stands in
    attention = "dot_product"
    notes.append("attention dot_product (XLA, masked by positions): context parallelism with cuDNN does not compile")
  else:
    attention = "blockwise"
    notes.append("attention blockwise: the layout (pipeline / context parallel) rules out the splash kernel")
  remat = r.remat
  if remat is None:
    remat = "minimal"
    notes.append(f"recompute '{r.recompute_raw or 'not published'}': minimal (Megatron's selective default)")
  elif not r.remat_exact:
    notes.append(f"recompute '{r.recompute_raw}' as the nearest policy '{remat}'")
  model = dict(n_layers=r.n_layers, d_model=r.d_model, n_heads=r.n_heads, n_kv_heads=r.n_kv_heads,
               head_dim=r.head_dim, d_ff=r.d_ff, vocab_size=r.vocab_size, max_seq_len=r.seq_len, remat=remat,
               mlp=r.mlp, tie_embeddings=r.tie_embeddings, attention=attention, attention_block=512,
               block="parallel" if r.parallel_block else "sequential", dtype="bfloat16", param_dtype="float32",
               scan_layers=True)
  if r.seq_len % 512:
    model["attention_block"] = r.seq_len
  micro = r.microbatches or 1
  if pipelined and r.microbatches == 0:
    micro = max(1, r.global_batch // max(1, r.data * r.fsdp))
    notes.append(f"micro-batch size not published: {micro} pipeline micro-batches of one sequence")
  if pipelined and r.virtual_stages != 1:
    notes.append("interleaved pipeline run as non-interleaved 1F1B (larger bubble)")
  mesh = dict(data=r.data, fsdp=r.fsdp, tensor=r.tensor, pipeline=r.pipeline, sequence=r.sequence,
              microbatches=micro, form="shard_map" if pipelined or cp else "jit",
              schedule="1f1b")
  if r.parallel_block:
    notes.append("parallel attention+MLP block (model.block=parallel)")
  if r.biases or r.learned_positions:
    notes.append("biases / learned positions left out")
  ov = [f"--config.model.{k}={v}" for k, v in model.items()]
  ov += [f"--config.data.seq_len={r.seq_len}", f"--config.data.global_batch={r.global_batch}"]
  ov += [f"--config.mesh.{k}={v}" for k, v in mesh.items()]
  ov.append(f"--config.name={r.id}")
  k = _slices(r)
  topology = targets.plan(r.hardware, r.n_chips // k).topology if tpu and k > 1 else None
  if topology:
    notes.append(f"{k} slices of {topology} over the data-center network")
  return ov, topology, notes


def predict_row(r: P.PublishedRun, backend: str = "auto", timeout_s: float = TIMEOUT_S,
                compile_budget: str = "75") -> dict:
  """The row's Prediction (JSON) from a ``python -m perfmodel predict`` child, or {'error': ...}."""
  ov, topology, notes = row_config(r)
  argv = [sys.executable, "-m", "perfmodel", "predict", "--config", BASE_CONFIG, "--hardware", r.hardware,
          "--backend", backend, "--compile-budget", str(compile_budget)]
  argv += (["--topology", topology] if topology else []) + ov
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  t0 = time.perf_counter()
  try:
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return {"error": f"predict timed out after {timeout_s:.0f} s", "mapping": notes}
  wall = time.perf_counter() - t0
  lines = [x for x in p.stdout.strip().splitlines() if x.startswith("{")]
  if p.returncode or not lines:
    err = [x for x in p.stderr.strip().splitlines() if x.strip()]
    return {"error": (err[-1] if err else f"exit {p.returncode}")[:400], "mapping": notes}
  out = json.loads(lines[-1])
  out["mapping"], out["child_wall_s"], out["command"] = notes, wall, " ".join(argv[1:])
  return out


def _terms(pred: dict) -> dict:
  """Where a prediction's time goes (seconds): matrix work, memory-bound work, exposed communication, pipeline
  lock-step idle."""
  b = pred.get("breakdown") or {}
  kinds = b.get("by_kind_s", {})
  return {"dot_s": kinds.get("dot", 0.0), "fusion_s": kinds.get("fusion", 0.0) + kinds.get("other", 0.0),
          "exposed_comm_s": b.get("exposed_comm_s", 0.0),
          "pipeline_idle_s": (pred.get("conditionals") or {}).get("lockstep_idle_s", 0.0)}


def run(csv: Optional[str] = None, limit: int = 0, ids: Optional[list] = None, png: Optional[str] = None,
        results: bool = True, backend: str = "auto", log=print, reprice: bool = False,
        save_programs: bool = False, compile_budget: str = "75") -> dict:
  """``reprice``: price the committed programs (perfmodel/calib/published_programs.py) in this process, nothing
  compiled; ``save_programs``: after each row, commit its compiled program there."""
  from perfmodel.calib import published_programs as PP  # noqa: PLC0415 (loads jax: only a run needs it)
  rows = P.included(P.load(csv))
  if ids:
    unknown = sorted(set(ids) - {r.id for r in rows})
    if unknown:
      raise SystemExit(f"--rows {unknown}: not included rows of {csv or P.default_path()} (see its ids)")
    rows = [r for r in rows if r.id in ids]
  if limit:
    rows = rows[:limit]
  per, preds, t0 = [], {}, time.perf_counter()
  for i, r in enumerate(rows):
    ov, topology, notes = row_config(r)
    out = dict(PP.reprice(r, ov, backend), mapping=notes) if reprice else predict_row(r, backend,
                                                                                      compile_budget=compile_budget)
    if save_programs and "error" not in out:
      PP.export(r, ov, topology)
    rec = {"id": r.id, "chip": r.hardware, "precision": r.precision, "source": r.source_key,
           "measured_s": r.measured_step_s, "n_chips": r.n_chips, "mapping": out.get("mapping", [])}
    if "error" in out:
      rec["error"] = out["error"]
      log(f"[{i + 1}/{len(rows)}] {r.id}: FAILED {out['error'][:200]}")
    else:
      preds[r.id] = out["step_time_s"]
      rec.update(predicted_s=out["step_time_s"], err_pct=100.0 * (out["step_time_s"] / r.measured_step_s - 1),
                 mfu=out.get("mfu"), peak_memory_bytes=out.get("peak_memory_bytes"),
                 fits_in_memory=out.get("fits_in_memory"), capacity_bytes=None, route=out.get("route"),
                 route_detail=out.get("route_detail"), compile_s=out.get("compile_s"),
                 child_wall_s=out.get("child_wall_s"), terms=_terms(out), assumptions=out.get("assumptions"),
                 stale_program=out.get("stale"))
      log(f"[{i + 1}/{len(rows)}] {r.id}: predicted {out['step_time_s']:.3f} s, published {r.measured_step_s:.3f} s "
          f"({rec['err_pct']:+.1f}%), peak {out.get('peak_memory_bytes', 0) / 2**30:.1f} GiB, "
          f"{rec['child_wall_s']:.0f} s")
    per.append(rec)
  return summarize(rows, per, preds, png=png, results=results, wall_s=time.perf_counter() - t0,
                   command=_command_tail(csv, limit, ids, backend) + (" --reprice" if reprice else
                                                                      f" --compile-budget {compile_budget}"))


def summarize(rows: list, per: list, preds: dict, png: Optional[str] = None, results: bool = False,
              wall_s: float = 0.0, command: str = "") -> dict:
  """Scores (perfmodel.calib.published.summarize) of the bf16 rows, the fp16 rows apart, memory violations, error
  terms by source; draws the PNG and appends the RESULTS row when asked."""
  from perfmodel import hardware  # noqa: PLC0415
  bf16 = [r for r in rows if r.precision == "bf16"]
  fp16 = [r for r in rows if r.precision == "fp16"]
  s = P.summarize(bf16, preds)
  s16 = P.summarize(fp16, preds) if fp16 else None
  cap = {}
  for rec in per:
    if rec.get("peak_memory_bytes") is not None:
      cap.setdefault(rec["chip"], hardware.load(rec["chip"]).mem_bytes)
      rec["capacity_bytes"] = cap[rec["chip"]]
  violations = [{"id": e["id"], "peak_gib": e["peak_memory_bytes"] / 2**30, "capacity_gib": e["capacity_bytes"] / 2**30}
                for e in per if e.get("peak_memory_bytes") and (e["peak_memory_bytes"] > e["capacity_bytes"]
                                                                or e.get("fits_in_memory") is False)]
  tpu = [e for e in per if e["chip"].startswith("tpu") and e.get("peak_memory_bytes") is not None]
  by_source_terms = {}
  for e in per:
    if "terms" in e:
      t = by_source_terms.setdefault(e["source"], {"n": 0, "mean_signed_pct": 0.0, **{k: 0.0 for k in e["terms"]}})
      t["n"] += 1
      t["mean_signed_pct"] += e["err_pct"]
      for k, v in e["terms"].items():
        t[k] += v / e["predicted_s"]  # share of the predicted step
  for t in by_source_terms.values():
    for k in list(t):
      if k != "n":
        t[k] /= t["n"]
  out = {"mape_pct": s["mape_pct"], "n_rows": s["n_rows"], "n_failed": sum(1 for e in per if "error" in e),
         "mean_signed_pct": s["mean_signed_pct"], "by_chip": s["by_chip"], "by_source": s["by_source"],
         "kendall_tau": {t: v["tau"] for t, v in s["kendall_tau"].items()}, "kendall_tau_mean": s["kendall_tau_mean"],
         "fp16": ({k: s16[k] for k in ("mape_pct", "n_rows", "by_source")} if s16 else None),
         "jax_xla_mape_pct": _mape([e for e in per if "err_pct" in e and e["precision"] == "bf16"
                                    and re.search(r"maxtext|paxml", e["source"], re.I)]),
         # rows whose program fits the chip: where the compiler refuses the program (it does not fit HBM) the
         # optimised HLO priced is its attempt at rematerialising its way down, not the program the row ran
         "fitting": {"n_rows": len(fit := [e for e in per if "err_pct" in e and e["precision"] == "bf16"
                                           and e.get("fits_in_memory") is not False]),
                     "mape_pct": _mape(fit),
                     "jax_xla_mape_pct": _mape([e for e in fit if re.search(r"maxtext|paxml", e["source"], re.I)])},
         "memory": {"tpu_rows_with_compiled_peak": len(tpu), "violations": violations},
         "terms_by_source": by_source_terms, "rows": per, "wall_s": wall_s}
  if png:
    _plot(per, png)
    out["png"] = png
  if results:
    _append_results(out, command)
  return out


def _mape(es: list) -> Optional[float]:
  return sum(abs(e["err_pct"]) for e in es) / len(es) if es else None


def _plot(per: list, path: str) -> None:
  import matplotlib  # noqa: PLC0415 (only a validation that draws needs it)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6, 6))
  ok = [e for e in per if "predicted_s" in e]
  for chip in sorted({e["chip"] for e in ok}):
    es = [e for e in ok if e["chip"] == chip]
    ax.scatter([e["measured_s"] for e in es], [e["predicted_s"] for e in es], s=14, label=f"{chip} ({len(es)})",
               marker="o" if all(e["precision"] == "bf16" for e in es) else "s")
  if ok:
    lo = min(min(e["measured_s"], e["predicted_s"]) for e in ok) / 1.5
    hi = max(max(e["measured_s"], e["predicted_s"]) for e in ok) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
  ax.set_xscale("log"), ax.set_yscale("log")
  ax.set_xlabel("published step time (s)"), ax.set_ylabel("predicted step time (s)")
  ax.set_title("perfmodel vs published training runs")
  ax.legend(fontsize=7)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches="tight")


def _command_tail(csv, limit, ids, backend) -> str:
  tail = " --published"
  tail += f" --csv {csv}" if csv else ""
  tail += f" --limit {limit}" if limit else ""
  tail += f" --rows {','.join(ids)}" if ids else ""
  return tail + (f" --backend {backend}" if backend != "auto" else "")


def _append_results(out: dict, command: str) -> None:
  path = os.path.join(ROOT, "benchmarks", "RESULTS.md")
  nums = {"mape_pct": out["mape_pct"], "n_rows": out["n_rows"], "n_failed": out["n_failed"],
          "jax_xla_mape_pct": out["jax_xla_mape_pct"], "kendall_tau_mean": out["kendall_tau_mean"],
          "fitting_rows": out["fitting"],
          "by_chip": {k: v["mape_pct"] for k, v in out["by_chip"].items()},
          "by_source": {k[:40]: v["mape_pct"] for k, v in out["by_source"].items()},
          "fp16_mape_pct": (out["fp16"] or {}).get("mape_pct"),
          "memory_violations": len(out["memory"]["violations"]), "wall_s": out["wall_s"]}
  nums = json.loads(json.dumps(nums), parse_float=lambda x: round(float(x), 3))
  with open(path, "a") as f:
    f.write(f"| {datetime.datetime.now().isoformat(timespec='minutes')} | python -m perfmodel validate{command} | "
            f"{platform.machine()} {os.cpu_count()} cores (shared) | {json.dumps(nums)} |\n")
