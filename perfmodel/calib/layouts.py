"""`python -m perfmodel search --run-top`: the ranking of `search` checked by a run on this host.

The top layouts of the analytic ranking (perfmodel/search.py) and the config's own are re-ranked with compiled
predictions, then every one of them is run and timed (perfmodel/calib/runners.py, the regime's clock): does the
predicted-best layout beat the default?
"""
from __future__ import annotations

from framework.config import Config, validate
from perfmodel import predict, program
from perfmodel.cost import regime
from perfmodel.calib.host import kendall_tau
from perfmodel.calib.runners import measure_train
from perfmodel.hardware import HardwareProfile


def _distinct(ranked, k: int) -> list:
  """The first k layouts that differ in what runs (effective mesh, rules where they matter, remat, micro-batches).
  Pipelined layouts included: their conditionals are priced per schedule (perfmodel/pipeline.py)."""
  picks, seen = [], set()
  for t, c, p in ranked:
    rules = c.mesh.rules if (c.mesh.data > 1 or c.mesh.fsdp > 1) else "-"
    key = (tuple(sorted(p.mesh.items())), rules, c.model.remat, c.mesh.microbatches)
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


def run_check(default_cfg: Config, ranked: list, n: int, hw: HardwareProfile, refine: int = 4) -> dict:
  """On this host: re-rank the top `refine` distinct layouts (plus the config's own) with the compiled-program
  prediction (the validated model), then run every one of them and the default, measured in the regime's
  clock (pinned core: process CPU time). Reports whether the predicted-best layout beats the default."""
  default = validate(default_cfg, n)
  cands = _distinct(ranked, refine)
  cands = [c for c in cands if _layout(c) != _layout(default)] + [default]
  rows = []
  for c in cands:
    try:
      cap = program.train_step(c, keep_compiled=True)
    except Exception as e:  # noqa: BLE001 - one layout that cannot be built must not hide the others' results
      rows.append({**_layout(c), "is_default": c is default, "error": f"{type(e).__name__}: {str(e)[:300]}"})
      continue
    pred = predict.predict(c, hw, captured=cap)
    r1 = measure_train(cap, c, reps=5)
    r2 = measure_train(cap, c, reps=5)
    meas = (bench.seconds(r1) + bench.seconds(r2)) / 2
    noise = max(bench.spread_pct(bench.view(r1)), bench.spread_pct(bench.view(r2)),
                50 * abs(bench.seconds(r1) - bench.seconds(r2)) / meas)
    rows.append({**_layout(c), "is_default": c is default, "predicted_s": pred.step_time_s,
                 "analytic_rank_s": next((t for t, cc, _ in ranked if cc is c), None), "measured_s": meas,
                 "noise_pct": noise, "clock": "cpu" if regime.pinned() else "wall"})
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
