"""`python -m perfmodel search`: enumerate layouts for a model on N devices, rank by predicted step time.

Candidates: every (data, fsdp, tensor, pipeline) factorisation of N that the config validator accepts,
x rules preset (default / zero3), x remat (none / dots / full), x micro-batches for pipelined ones.
Each is priced with the analytic graph (no compile: hundreds of layouts per second) and filtered by
the analytic memory estimate against the profile's capacity. With --run-top on this host, the
top-ranked and the config's own layout are compiled and timed, so the ranking is checked by a run.
"""
from __future__ import annotations

import dataclasses
import itertools

from framework.config import Config, ConfigError, MeshConfig, validate
from perfmodel import predict
from perfmodel.hardware import HardwareProfile


def _divisors(n):
  return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: Config, n: int):
  for dp, fs, tp in itertools.product(_divisors(n), repeat=3):
    if n % (dp * fs * tp):
      continue
    pp = n // (dp * fs * tp)
    for rules, remat in itertools.product(("default", "zero3"), ("none", "dots", "full")):
      if rules == "zero3" and fs * dp == 1:
        continue
      for mb in ((1,) if pp == 1 else (pp, 2 * pp, 4 * pp)):
        mesh = MeshConfig(data=dp, fsdp=fs, tensor=tp, pipeline=pp, sequence=1, rules=rules,
                          form="shard_map" if pp > 1 else cfg.mesh.form, microbatches=mb, schedule="1f1b")
        c = dataclasses.replace(cfg, mesh=mesh, model=dataclasses.replace(cfg.model, remat=remat))
        try:
          yield validate(c, n)
        except ConfigError:
          continue


def run(cfg: Config, hw: HardwareProfile, n: int, top: int = 10, run_top: bool = False, backend: str = "auto",
        config_path: str = "", overrides=(), refine: int = 4) -> dict:
  ranked = []
  n_tried = 0
  for c in candidates(cfg, n):
    n_tried += 1
    p = predict.predict_train_analytic(c, hw, backend)
    if p["peak_memory_bytes"] > hw.mem_bytes:
      continue
    ranked.append((p["step_time_s"], c, p))
  ranked.sort(key=lambda t: t[0])
  out = {"devices": n, "hardware": hw.name, "n_candidates": n_tried, "n_fit_memory": len(ranked),
         "ranking": [{"rank": i + 1, "step_time_s": t, "tokens_per_s": p["tokens_per_s"], "mfu": p["mfu"],
                      "mesh": p["mesh"], "rules": c.mesh.rules, "remat": c.model.remat,
                      "microbatches": c.mesh.microbatches, "peak_memory_bytes": p["peak_memory_bytes"]}
                     for i, (t, c, p) in enumerate(ranked[:top])]}
  if run_top and ranked:
    out["run_check"] = _run_check(cfg, ranked, n, hw, refine)
  return out


def _distinct(ranked, k: int) -> list:
  """The first k layouts that differ in what runs (effective mesh, rules where they matter, remat, micro-batches).
  Pipelined layouts included: their conditionals are priced per schedule (perfmodel/branches.py)."""
  picks, seen = [], set()
  for t, c, p in ranked:
    rules = c.mesh.rules if (c.mesh.data > 1 or c.mesh.fsdp > 1) else "-"
    key = (tuple(sorted(p["mesh"].items())), rules, c.model.remat, c.mesh.microbatches)
    if key in seen:
      continue
    seen.add(key)
    picks.append(c)
    if len(picks) == k:
      break
  return picks


def _layout(c: Config) -> dict:
  out = {"mesh": {k: v for k, v in c.mesh.sizes().items() if v != 1}, "rules": c.mesh.rules, "remat": c.model.remat}
  if c.mesh.pipeline > 1:
    out.update(microbatches=c.mesh.microbatches, schedule=c.mesh.schedule)
  return out


def _run_check(default_cfg: Config, ranked: list, n: int, hw: HardwareProfile, refine: int) -> dict:
  """On this host: re-rank the top `refine` distinct layouts (plus the config's own) with the compiled-program
  prediction (the validated model), then run every one of them and the default, measured in the regime's
  clock (pinned core: process CPU time). Reports whether the predicted-best layout beats the default."""
  from perfmodel import bench, capture
  from perfmodel.validate import kendall_tau, measure_train
  default = validate(default_cfg, n)
  cands = _distinct(ranked, refine)
  cands = [c for c in cands if _layout(c) != _layout(default)] + [default]
  rows = []
  for c in cands:
    try:
      cap = capture.train_step(c, keep_compiled=True)
    except Exception as e:  # noqa: BLE001 - one layout that cannot be built must not hide the others' results
      rows.append({**_layout(c), "is_default": c is default, "error": f"{type(e).__name__}: {str(e)[:300]}"})
      continue
    pred = predict.predict_train(c, hw, captured=cap)
    r1 = measure_train(cap, c, reps=5)
    r2 = measure_train(cap, c, reps=5)
    meas = (bench.seconds(r1) + bench.seconds(r2)) / 2
    noise = max(bench.spread_pct(bench.view(r1)), bench.spread_pct(bench.view(r2)),
                50 * abs(bench.seconds(r1) - bench.seconds(r2)) / meas)
    rows.append({**_layout(c), "is_default": c is default, "predicted_s": pred["step_time_s"],
                 "analytic_rank_s": next((t for t, cc, _ in ranked if cc is c), None), "measured_s": meas,
                 "noise_pct": noise, "clock": "cpu" if bench.pinned() else "wall"})
    del cap
  failed = [r for r in rows if "error" in r]
  rows = [r for r in rows if "error" not in r]
  best = min((r for r in rows if not r["is_default"]), key=lambda r: r["predicted_s"], default=None)
  dflt = next((r for r in rows if r["is_default"]), None)
  if dflt is None:
    return {"layouts": rows, "failed": failed, "error": "the config's own layout could not be built"}
  res = {"layouts": rows, "failed": failed, "top": best, "default": dflt}
  if best is not None:
    res["top_beats_default"] = best["measured_s"] < dflt["measured_s"]
    res["speedup_measured"] = dflt["measured_s"] / best["measured_s"]
    res["speedup_predicted"] = dflt["predicted_s"] / best["predicted_s"]
    res["kendall_tau_measured_vs_predicted"] = kendall_tau([r["measured_s"] for r in rows],
                                                           [r["predicted_s"] for r in rows])
  return res
