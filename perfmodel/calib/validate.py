"""`python -m perfmodel validate`: the suite measured on this host against the model's predictions.

Every config of the suite (perfmodel/calib/suite.py ``SUITE`` training steps, ``INFER`` decode loops) is measured in
``rounds`` rounds (perfmodel/calib/runners.py: a fresh child per device count) or read from stored measurement files,
pooled per config and read in the statistic the profile was fitted on (perfmodel/calib/host.py), then predicted from
its compiled program with ``perfmodel.predict`` and scored. One headline error: the training step-time MAPE
(``mape``; decode: ``tpot_mape``), with beside it what a perfect model scores on the same rounds (``host_floor``:
each round predicted by the median of the others). Also Kendall's tau of the training ranking, the regret of picking
the predicted-fastest config, and the peak-memory error against the compiler's memory_analysis. Writes a PNG where
asked; ``results=True`` (``validate --record``) writes the committed benchmarks/data/perfmodel_validate.json.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys

import numpy as np

from perfmodel import hardware, predict, program
from perfmodel.calib import bench, runners, store
from perfmodel.calib.host import HostSpeed, kendall_tau
from perfmodel.cost import chain as chain_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMITTED_PNG = os.path.join(REPO, "benchmarks", "perfmodel_validate.png")  # written by ``validate --record``
RECORD_JSON = os.path.join(REPO, "benchmarks", "data", "perfmodel_validate.json")  # written by ``validate --record``


def _clock(caches: list, pinned_now: bool) -> str:
  """The clock of the measurements: CPU time iff every one was taken pinned (stored ones carry their regime)."""
  regimes = [m.get("regime", {}) for c in caches for m in c.values()]
  if regimes and all(r.get("pinned_core") is not None for r in regimes):
    return "cpu"
  return "cpu" if pinned_now and not regimes else "wall"


def measure(suite, suite_path, caches: list, entries: list, reps: int, isolate: bool, save) -> None:
  """Fills every round of ``caches`` with the entries it lacks."""
  for ri, cache in enumerate(caches):
    missing = [e for e in entries if e["name"] not in cache]
    if not missing:
      continue
    if not isolate:
      cache.update(runners.measure_entries(suite_path, [e["name"] for e in missing], reps))
      save()
      continue
    groups = {}
    for entry in missing:
      groups.setdefault(runners.entry_cfg(entry, suite.BASE)[1], []).append(entry["name"])
    for n_dev, names in sorted(groups.items()):
      print(f"round {ri + 1}/{len(caches)}: measuring {names} in a child process with {n_dev} host device(s)",
            file=sys.stderr, flush=True)
      cache.update(runners.measure_isolated(suite_path, names, n_dev, reps, probe=False))
      save()


def run(suite_path=None, reps: int = 7, backend: str = "auto", png: str = None, results: bool = False,
        limit: int = 0, hardware_name: str = "cpu", measurements=None, hlo_cache: str = None,
        isolate: bool = True, rounds: int = 1) -> dict:
  """``measurements``: a JSON file of measurements by config name (one round, or ``{"rounds": [...]}``), or a list
  of such files (their rounds pooled, read only). Entries found there are not measured again (predictions always
  come from a fresh compile, or ``hlo_cache``); new measurements go into a single given file. ``rounds``: how many
  times to measure the whole suite when nothing is stored (a config's figure is the median over its rounds: on a
  shared host one config measured twice half an hour apart can move by 20%). ``isolate``: one child process per
  device count (False: this process, with its own device count)."""
  hw = hardware.load(hardware_name)
  host = HostSpeed(hw.calibration.step_statistic if hw.name == "cpu" else "median")
  resolved = chain_lib.resolve_backend(hw, backend)
  suite = runners.load_suite(suite_path)
  files = [measurements] if isinstance(measurements, str) else list(measurements or [])
  stored = [f for f in files if os.path.exists(f)]
  taken = ", ".join(datetime.datetime.fromtimestamp(os.path.getmtime(f)).isoformat(timespec="minutes")
                    for f in stored)
  caches = [c for f in stored for c in host.load(f)] or [{} for _ in range(max(1, rounds))]
  writable = files[0] if len(files) == 1 else None

  def save():
    if writable:
      store.write_json(writable, caches[0] if len(caches) == 1 else {"rounds": caches}, indent=1)
  entries = suite.SUITE[:limit] if limit else suite.SUITE
  infer_entries = list(getattr(suite, "INFER", [])) if not limit else []
  measure(suite, suite_path, caches, entries + infer_entries, reps, isolate, save)
  clock = _clock(caches, bench.pinned())
  names = [e["name"] for e in entries + infer_entries]
  caches = [{n: host.read(c[n]) for n in names} for c in caches]  # the profile's statistic, scored entries only
  rows = []
  for entry in entries + infer_entries:
    cfg, n, kind = runners.entry_cfg(entry, suite.BASE)
    m = host.pool([c[entry["name"]] for c in caches])
    if kind == "train":
      cap = runners.cached_capture(hlo_cache, entry["name"], lambda cfg=cfg: program.train_step(cfg))
    else:
      g2 = entry["gen_lens"][1]
      cap = runners.cached_capture(hlo_cache, entry["name"], lambda cfg=cfg, e=entry, g2=g2: program.sampler(
          cfg, e["batch"], e["prompt_len"], g2))
    if kind == "train":
      pred = predict.predict(cfg, hw, backend=backend, captured=cap)
      predicted = pred.step_time_s
    else:
      pred = predict.predict(cfg, hw, mode="infer", backend=backend, batch=entry["batch"],
                             prompt_len=entry["prompt_len"], gen_len=entry["gen_lens"][1], captured=cap)
      predicted = pred.tpot_s
    meas, noise = m["measured_s"], m["noise_pct"]
    err = 100 * (predicted - meas) / meas if meas > 0 else float("nan")
    row = dict(name=entry["name"], kind=kind, measured_s=meas, predicted_s=predicted, err_pct=err, noise_pct=noise,
               rounds=m["rounds"], round_spread_pct=m["round_spread_pct"], host_devices=m.get("host_devices"))
    if kind == "train":
      row.update(n_devices=n, predict_s=pred.predict_s, wall_s=m["wall_s"], mem_pred=pred.peak_memory_bytes,
                 mem_xla=cap.memory["peak_bytes"], mem_analytic=pred.memory_analytic["total"],
                 priced_by=pred.breakdown["priced_by"])
    rows.append(row)
    what = "" if kind == "train" else "TPOT "
    print(f"{entry['name']:>16}  {what}measured {meas * 1e3:9.3f} ms  predicted {predicted * 1e3:9.3f} ms  "
          f"err {err:+6.1f}%  noise ±{noise:4.1f}%" + (f"  ({n} dev)" if kind == "train" else ""),
          file=sys.stderr, flush=True)
  out = score(rows)
  out.update({
      "n_configs": len([r for r in rows if r["kind"] == "train"]), "rounds": len(caches),
      "statistic": host.statistic,
      "host_floor": host.floor(caches, [e["name"] for e in entries], [e["name"] for e in infer_entries]),
      "clock": clock, "regime": bench.regime(),
      "calibration_loo_mape": (hw.calibration.compositions.get("learned").loo_mape
                               if "learned" in hw.calibration.compositions else None),
      "hardware": hw.name, "calibrated": hw.calibrated, "backend": backend, "backend_resolved": resolved,
      "load_avg": os.getloadavg()[0], "rows": rows})
  if png:
    _plot(rows, png)
    out["png"] = png
  if results:
    # a row priced from stored measurements says so (and which), so it is not read as a fresh measurement
    tail = (f" --backend {backend}" if backend != "auto" else "") + (
        f" --rounds {len(caches)}" if len(caches) > 1 and not stored else "")
    _record(out, "python -m perfmodel validate --record" + tail
            + (f" --measurements {' '.join(files)}" if files else ""), taken if stored else None)
  return out


def score(rows: list) -> dict:
  """The errors of a model over validation rows ({kind, measured_s, predicted_s, err_pct, noise_pct[, mem_*,
  predict_s]})."""
  train = [r for r in rows if r["kind"] == "train"]
  infer = [r for r in rows if r["kind"] == "infer"]
  meas, prd = [r["measured_s"] for r in train], [r["predicted_s"] for r in train]
  tps_m = [1 / m for m in meas]
  regret = 100 * (1 - tps_m[int(np.argmin(prd))] / max(tps_m))
  return {
      "mape": float(np.mean([abs(r["err_pct"]) for r in train])),
      "tpot_mape": float(np.mean([abs(r["err_pct"]) for r in infer])) if infer else None,
      "kendall_tau": kendall_tau(meas, prd), "top1_regret_pct": regret,
      "signed_err_pct": {r["name"]: round(r["err_pct"], 2) for r in train},
      "noise_pct": float(np.median([r["noise_pct"] for r in train])),
      "round_spread_pct": float(np.median([r["round_spread_pct"] for r in train])),
      "tpot_n_configs": len(infer),
      "tpot_noise_pct": float(np.median([r["noise_pct"] for r in infer])) if infer else None,
      "peak_memory_max_err_pct_vs_memory_analysis": float(np.max([abs(r["mem_pred"] - r["mem_xla"]) / r["mem_xla"]
                                                                  * 100 for r in train])),
      "peak_memory_analytic_mape_vs_memory_analysis": float(np.mean([abs(r["mem_analytic"] - r["mem_xla"])
                                                                     / r["mem_xla"] * 100 for r in train])),
      "predict_s_max": float(max(r["predict_s"] for r in train)),
  }


def _plot(rows, path):
  import matplotlib  # noqa: PLC0415 (heavy: matplotlib, ~1 s; only a validation that draws needs it)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 (after matplotlib.use('Agg'))
  fig, ax = plt.subplots(figsize=(5, 5))
  for kind, mk in (("train", "o"), ("infer", "^")):
    rr = [r for r in rows if r["kind"] == kind]
    if not rr:
      continue
    ax.errorbar([r["measured_s"] * 1e3 for r in rr], [r["predicted_s"] * 1e3 for r in rr],
                xerr=[r["measured_s"] * 1e3 * r["noise_pct"] / 100 for r in rr], fmt=mk, label=kind, capsize=2)
  lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.5
  hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.5
  ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
  ax.set_xscale("log"), ax.set_yscale("log")
  ax.set_xlabel("measured (ms)"), ax.set_ylabel("predicted (ms)")
  ax.set_title("perfmodel: predicted vs measured (this CPU)")
  ax.legend()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=120, bbox_inches="tight")


def _record(out: dict, command: str, measured: str = None) -> None:
  """Writes the committed record of this run, benchmarks/data/perfmodel_validate.json: the result with the command,
  machine and date (``measured``: when stored measurements were taken, where the run priced stored ones)."""
  out.update({"command": command, "machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
              "date": datetime.datetime.now().isoformat(timespec="minutes")})
  if measured:
    out["measurements_taken"] = measured
  with open(RECORD_JSON, "w") as f:
    json.dump(out, f, indent=1, default=str)
