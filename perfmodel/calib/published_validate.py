"""`python -m perfmodel validate --published`: every included published training row through ``predict``.

Each row (perfmodel/calib/published.py) becomes the command line of the predict contract by the mapping rules of
perfmodel/calib/published_mapping.py, ``python -m perfmodel predict --config experiments/configs/llama3_70b.py
--hardware H [--topology T] --config.*=...``, run in a child process (a compiler abort or a memory blow-up costs one
row, not the run); the child compiles the step for the target (``target_compile``, cached in
``$PRISMLLM_CACHE/programs/``). ``--save-programs`` commits each compiled program (published_programs.py) and prices
the row from the committed file, so ``--reprice`` (the committed programs priced in this process, nothing compiled)
reproduces the run. A row whose features have no path in this checkout is reported ``not compiled``, never
compiled without them. Nothing is fitted: the rows only score the model.

Scores (published_score.py), each beside the constant-MFU baseline on the same rows: ``included`` (bf16 + fp8 rows,
the headline), ``design`` and ``heldout`` (published.heldout_rule), ``fp16`` (scored apart), and, labelled as a
diagnosis, the included rows whose program fits the chip. Per row: MFU above the chip's best matmul fraction and
programs that do not fit are flagged, the latter with what is missing (published_checks.py).

``--record`` writes the run's JSON, with its command, host and time (``run_at``), to
``benchmarks/data/published_validation.json``; ``python -m benchmarks.results`` renders it into benchmarks/RESULTS.md.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from typing import Optional

from perfmodel.calib import published as P
from perfmodel.calib import published_checks as C
from perfmodel.calib import published_mapping as M
from perfmodel.calib import published_score as S

ROOT = P.ROOT
BASE_CONFIG = P.BASE_CONFIG
TIMEOUT_S = 3600
JSON_PATH = os.path.join(ROOT, "benchmarks", "data", "published_validation.json")
INCLUDED = ("bf16", "fp8")  # the headline's precisions; fp16 rows are scored apart


def predict_row(r: P.PublishedRun, m: M.RowMapping, backend: str = "auto", timeout_s: float = TIMEOUT_S,
                compile_budget: str = "75") -> dict:
  """The row's Prediction (JSON) from a ``python -m perfmodel predict`` child, or {'error': ...}."""
  if m.error:
    return {"error": m.error}
  argv = [sys.executable, "-m", "perfmodel", "predict", "--config", BASE_CONFIG, "--hardware", r.hardware,
          "--backend", backend, "--compile-budget", str(compile_budget), "--framework", m.framework]
  argv += (["--topology", m.topology] if m.topology else []) + m.overrides
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  t0 = time.perf_counter()
  try:
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    return {"error": f"predict timed out after {timeout_s:.0f} s"}
  wall = time.perf_counter() - t0
  lines = [x for x in p.stdout.strip().splitlines() if x.startswith("{")]
  if p.returncode or not lines:
    err = [x for x in p.stderr.strip().splitlines() if x.strip()]
    return {"error": (err[-1] if err else f"exit {p.returncode}")[:400]}
  out = json.loads(lines[-1])
  out["child_wall_s"], out["program_overrides"] = wall, m.overrides
  return out


def _terms(pred: dict) -> dict:
  """Where a prediction's time goes (seconds): matrix work, memory-bound work, exposed communication, pipeline
  lock-step idle."""
  b = pred.get("breakdown") or {}
  kinds = b.get("by_kind_s", {})
  return {"dot_s": kinds.get("dot", 0.0), "fusion_s": kinds.get("fusion", 0.0) + kinds.get("other", 0.0),
          "exposed_comm_s": b.get("exposed_comm_s", 0.0),
          "pipeline_idle_s": (pred.get("conditionals") or {}).get("lockstep_idle_s", 0.0)}


def _record(r: P.PublishedRun, m: M.RowMapping, out: dict) -> dict:
  rec = {"id": r.id, "chip": r.hardware, "precision": r.precision, "split": r.split, "source": r.source_key,
         "table": r.table, "n_chips": r.n_chips, "measured_s": r.measured_step_s,
         "baseline_s": S.baseline_step_s(r), "mapping": m.notes,
         "features": {k: f.value for k, f in m.features.items()}}
  rec["baseline_err_pct"] = 100.0 * (rec["baseline_s"] / r.measured_step_s - 1)
  if "error" in out:
    rec["error"] = out["error"]
    return rec
  step = out["step_time_s"]
  rec.update(predicted_s=step, err_pct=100.0 * (step / r.measured_step_s - 1), mfu=out.get("mfu"),
             peak_memory_bytes=out.get("peak_memory_bytes"), fits_in_memory=out.get("fits_in_memory"),
             route=out.get("route"), route_detail=out.get("route_detail"), compile_s=out.get("compile_s"),
             terms=_terms(out), assumptions=out.get("assumptions"), stale_reasons=out.get("stale_reasons", []),
             flags=[])
  flag = C.mfu_flag(r, out)
  if flag:
    rec["flags"].append(flag)
  if out.get("fits_in_memory") is False:
    rec["memory_diagnosis"] = C.memory_diagnosis(r, m.features, out["program_overrides"], out)
    rec["flags"].append({"flag": "does_not_fit", "diagnosis": rec["memory_diagnosis"]})
  return rec


def run(csv: Optional[str] = None, limit: int = 0, ids: Optional[list] = None, png: Optional[str] = None,
        record: bool = False, backend: str = "auto", log=print, reprice: bool = False, save_programs: bool = False,
        strict: bool = False, compile_budget: str = "75") -> dict:
  """``reprice``: price the committed programs in this process, nothing compiled; ``save_programs``: commit each
  compiled program and price the row from it; ``strict``: a stale program is an error, not a flagged prediction;
  ``record``: write the JSON (needs every priced program committed: reprice or save_programs)."""
  from perfmodel.calib import published_programs as PP  # noqa: PLC0415 (loads jax: only a run needs it)
  if record and not (reprice or save_programs):
    raise SystemExit("--record writes what --reprice reproduces: add --save-programs (compile) or --reprice")
  rows = P.included(P.load(csv), precision=None)
  if ids:
    unknown = sorted(set(ids) - {r.id for r in rows})
    if unknown:
      raise SystemExit(f"--rows {unknown}: not included rows of {csv or P.default_path()} (see its ids)")
    rows = [r for r in rows if r.id in ids]
  if limit:
    rows = rows[:limit]
  run_at, t0, per = datetime.datetime.now().isoformat(timespec="seconds"), time.perf_counter(), []
  for i, r in enumerate(rows):
    m = M.row_config(r)
    if reprice:
      out = PP.reprice(r, m, backend)
    else:
      out = predict_row(r, m, backend, compile_budget=compile_budget)
      if save_programs and "error" not in out:
        try:
          PP.export(r, m)
          out = PP.reprice(r, m, backend)
        except FileNotFoundError as e:
          out = {"error": str(e)}
    if strict and out.get("stale_reasons"):
      out = {"error": "stale program: " + "; ".join(out["stale_reasons"])}
    rec = _record(r, m, out)
    per.append(rec)
    if "error" in rec:
      log(f"[{i + 1}/{len(rows)}] {r.id}: {rec['error'][:200]}")
    elif r.split == "heldout":  # its error is in the JSON and the held-out aggregate, not in the log one designs by
      log(f"[{i + 1}/{len(rows)}] {r.id} (heldout): priced" + (", stale" if rec["stale_reasons"] else ""))
    else:
      log(f"[{i + 1}/{len(rows)}] {r.id} ({r.split}): predicted {rec['predicted_s']:.3f} s, published "
          f"{r.measured_step_s:.3f} s ({rec['err_pct']:+.1f}%; baseline {rec['baseline_err_pct']:+.1f}%)"
          + (", stale" if rec["stale_reasons"] else "") + ("".join(f", {f['flag']}" for f in rec["flags"])))
  tail = _command_tail(csv, limit, ids, backend) + (" --reprice" if reprice else f" --compile-budget {compile_budget}")
  tail += (" --save-programs" if save_programs else "") + (" --strict" if strict else "")
  out = summarize(rows, per, wall_s=time.perf_counter() - t0, command="python -m perfmodel validate" + tail,
                  run_at=run_at)
  for line in report_lines(out):
    log(line)
  if png:
    _plot(per, png)
    out["png"] = png
  if record:
    write_record(out, record_path(csv))
  return out


def record_path(csv: Optional[str]) -> str:
  """Where ``--record`` writes: published_validation.json for the default rows, <name>_validation.json beside
  another ``*_training.csv`` (published_moe_training.csv -> published_moe_validation.json)."""
  if not csv or os.path.abspath(csv) == os.path.abspath(P.default_path()):
    return JSON_PATH
  name = os.path.basename(csv)
  if not name.endswith("_training.csv"):
    raise SystemExit(f"--record with --csv {csv}: name the rows file <name>_training.csv (its record is "
                     f"<name>_validation.json beside it)")
  return os.path.join(os.path.dirname(os.path.abspath(csv)), name.replace("_training.csv", "_validation.json"))


def summarize(rows: list, per: list, wall_s: float = 0.0, command: str = "", run_at: str = "") -> dict:
  """Scores of the run (the model beside the baseline), counts of what was not priced, stale and flagged."""
  from perfmodel.calib import published_programs as PP  # noqa: PLC0415
  preds = {e["id"]: e["predicted_s"] for e in per if "predicted_s" in e}
  by_id = {e["id"]: e for e in per}
  inc = [r for r in rows if r.precision in INCLUDED]
  groups = {"included": inc, "design": [r for r in inc if r.split == "design"],
            "heldout": [r for r in inc if r.split == "heldout"],
            "fp16": [r for r in rows if r.precision == "fp16"],
            "fits_chip_diagnosis": [r for r in inc if by_id[r.id].get("fits_in_memory") is True]}
  scores = {k: S.score(v, preds) for k, v in groups.items()}
  priced = [e for e in per if "predicted_s" in e]
  mem = [e for e in priced if e.get("fits_in_memory") is not None and e["precision"] in INCLUDED]
  not_compiled, failed = {}, []
  for e in per:
    if "error" in e:
      key = e["error"].split(":", 2)[1].strip() if e["error"].startswith("not compiled") else ""
      (not_compiled.setdefault(key, []) if key else failed).append(e["id"])
  return {
      "run_at": run_at, "command": command, "wall_s": wall_s, "host": f"{platform.machine()} {os.cpu_count()} cores",
      "code": PP.code_version(), "baseline": f"step = model FLOPs ({S.BASELINE_CONVENTION}) / (chips x bf16 peak "
                                             f"x {S.BASELINE_MFU})",
      "n_rows": len(rows), "n_priced": len(priced), "n_failed": len(failed), "failed": failed,
      "not_compiled": not_compiled, "n_not_compiled": sum(len(v) for v in not_compiled.values()),
      "stale": {e["id"]: e["stale_reasons"] for e in priced if e["stale_reasons"]},
      "fits": {"n_fit": sum(1 for e in mem if e["fits_in_memory"]), "n_checked": len(mem),
               "pct": 100.0 * sum(1 for e in mem if e["fits_in_memory"]) / len(mem) if mem else None,
               "not_fitting": {e["id"]: e.get("memory_diagnosis", "") for e in mem if not e["fits_in_memory"]}},
      "flagged_mfu": [e["id"] for e in priced if any(f["flag"] == "mfu_above_best_matmul" for f in e["flags"])],
      "scores": scores, "terms_by_source": _terms_by_source(priced), "rows": per}


def _terms_by_source(priced: list) -> dict:
  out = {}
  for e in priced:
    t = out.setdefault(e["source"], {"n": 0, "mean_signed_pct": 0.0, **{k: 0.0 for k in e["terms"]}})
    t["n"] += 1
    t["mean_signed_pct"] += e["err_pct"]
    for k, v in e["terms"].items():
      t[k] += v / e["predicted_s"]  # share of the predicted step
  for t in out.values():
    for k in list(t):
      if k != "n":
        t[k] /= t["n"]
  return out


def report_lines(out: dict) -> list:
  """What a reader needs first: each score beside the baseline, then what was not priced, stale or flagged."""
  sc = out["scores"]
  lines = [f"published rows: {out['n_rows']} included, {out['n_priced']} priced, {out['n_not_compiled']} not "
           f"compiled, {out['n_failed']} failed; baseline: {out['baseline']}"]
  lines += S.lines("included (bf16 + fp8, headline)", sc["included"])
  for k, name in (("design", "design rows"), ("heldout", "held-out rows"), ("fp16", "fp16 rows (scored apart)"),
                  ("fits_chip_diagnosis", "rows whose program fits the chip (diagnosis, not a headline)")):
    lines += S.lines(name, sc[k], groups=("by_chip",))
  f = out["fits"]
  if f["n_checked"]:
    lines.append(f"fit the chip: {f['n_fit']} of {f['n_checked']} ({f['pct']:.0f}%; acceptance >= 95%)")
  for reason, ids in out["not_compiled"].items():
    lines.append(f"not compiled ({len(ids)}): {reason}")
  if out["stale"]:
    lines.append(f"stale programs: {len(out['stale'])} of {out['n_priced']} priced (their scores are not of this "
                 f"checkout's mapping or code: recompile with --save-programs)")
  if out["flagged_mfu"]:
    lines.append(f"MFU above the chip's best matmul fraction: {', '.join(out['flagged_mfu'])}")
  return lines


def write_record(out: dict, json_path: str = JSON_PATH) -> None:
  """The run's JSON (``python -m benchmarks.results`` renders benchmarks/RESULTS.md from it)."""
  os.makedirs(os.path.dirname(json_path), exist_ok=True)
  with open(json_path, "w") as f:
    json.dump(out, f, indent=1, default=str)
    f.write("\n")


def _plot(per: list, path: str) -> None:
  import matplotlib  # noqa: PLC0415 (only a validation that draws needs it)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6, 6))
  ok = [e for e in per if "predicted_s" in e]
  for chip in sorted({e["chip"] for e in ok}):
    es = [e for e in ok if e["chip"] == chip]
    ax.scatter([e["measured_s"] for e in es], [e["predicted_s"] for e in es], s=14, label=f"{chip} ({len(es)})")
  if ok:
    ax.scatter([e["measured_s"] for e in ok], [e["baseline_s"] for e in ok], s=8, c="0.6", marker="x",
               label="constant-MFU baseline")
    lo = min(min(e["measured_s"], e["predicted_s"], e["baseline_s"]) for e in ok) / 1.5
    hi = max(max(e["measured_s"], e["predicted_s"], e["baseline_s"]) for e in ok) * 1.5
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
