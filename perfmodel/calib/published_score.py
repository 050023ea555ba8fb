"""Scores of predicted step times against published ones, each beside the constant-MFU baseline on the same rows.

The baseline predicts every row at one MFU: ``step = model FLOPs / (chips x bf16 peak x 0.5)``, its model FLOPs
counted by one convention for every row, 6 N_all tokens + causal attention 6 L H hd S^2 B
(:func:`model_flops`, ``published.flops_per_step(r, 'maxtext_6n_causal')``): the issue's 17.1% over the 107 bf16
rows reproduces with it. Each score (:func:`score`) carries, for the model and the baseline alike: MAPE, mean
signed error, Kendall tau over all its rows (``tau_global``) and within each published table (``tau_tables``, the
row-weighted mean over tables of 2+ rows), and the same by chip and by source.
"""
from __future__ import annotations

import math
from typing import Optional

from perfmodel.calib import published as P

BASELINE_MFU = 0.5
BASELINE_CONVENTION = "maxtext_6n_causal"


def model_flops(r: P.PublishedRun) -> float:
  """FLOPs of one step by the baseline's convention (6 N_all tokens + causal attention), the rows' own layers."""
  return P.flops_per_step(r, BASELINE_CONVENTION)


def baseline_step_s(r: P.PublishedRun) -> float:
  return model_flops(r) / (r.n_chips * P.bf16_peak(r.hardware) * BASELINE_MFU)


def mfu_of(r: P.PublishedRun, step_s: float) -> float:
  """The MFU a step time means for the row, in the baseline's convention (bf16 peak)."""
  return model_flops(r) / (step_s * r.n_chips * P.bf16_peak(r.hardware))


def kendall_tau(x, y) -> Optional[float]:
  """Kendall's tau-b of two equal-length sequences (ties handled); None with fewer than 2 pairs or no variation."""
  n = len(x)
  if n != len(y):
    raise ValueError("kendall_tau needs sequences of equal length")
  conc = disc = tx = ty = 0
  for i in range(n):
    for j in range(i + 1, n):
      a, b = x[i] - x[j], y[i] - y[j]
      if a == 0 and b == 0:
        continue
      if a == 0:
        tx += 1
      elif b == 0:
        ty += 1
      elif (a > 0) == (b > 0):
        conc += 1
      else:
        disc += 1
  denom = math.sqrt((conc + disc + tx) * (conc + disc + ty))
  return (conc - disc) / denom if denom else None


def _err_stats(errs: list) -> dict:
  if not errs:
    return {"n": 0, "mape_pct": None, "mean_signed_pct": None}
  return {"n": len(errs), "mape_pct": sum(abs(e) for e in errs) / len(errs), "mean_signed_pct": sum(errs) / len(errs)}


def _taus(es: list, key: str) -> tuple:
  """(global tau, row-weighted mean of within-table taus, {table: tau})."""
  glob = kendall_tau([e["measured_s"] for e in es], [e[key] for e in es]) if len(es) > 1 else None
  tables = {}
  for e in es:
    tables.setdefault(e["table"], []).append(e)
  by, weighted, total = {}, 0.0, 0
  for t, tes in sorted(tables.items()):
    tau = kendall_tau([e["measured_s"] for e in tes], [e[key] for e in tes]) if len(tes) > 1 else None
    by[t] = {"n": len(tes), "tau": tau}
    if tau is not None:
      weighted, total = weighted + tau * len(tes), total + len(tes)
  return glob, (weighted / total if total else None), by


def _predictor(es: list, key: str) -> dict:
  errs = [100.0 * (e[key] / e["measured_s"] - 1.0) for e in es]
  out = _err_stats(errs)
  out["tau_global"], out["tau_tables"], out["tau_by_table"] = _taus(es, key)
  for group, name in (("chip", "by_chip"), ("source", "by_source")):
    groups = {}
    for e, err in zip(es, errs):
      groups.setdefault(e[group], []).append(err)
    out[name] = {k: _err_stats(v) for k, v in sorted(groups.items())}
  return out


def score(rows: list, predictions: dict) -> dict:
  """{"n", "model", "baseline"} over the rows that have a prediction and a measured step (``predictions``: {row id:
  seconds}); rows without one are counted in ``n_skipped``."""
  es, skipped = [], 0
  for r in rows:
    p = predictions.get(r.id)
    if p is None or r.measured_step_s is None:
      skipped += 1
      continue
    es.append({"id": r.id, "chip": r.hardware, "source": r.source_key, "table": r.table,
               "measured_s": r.measured_step_s, "model_s": float(p), "baseline_s": baseline_step_s(r)})
  return {"n": len(es), "n_skipped": skipped, "model": _predictor(es, "model_s"),
          "baseline": _predictor(es, "baseline_s")}


def _f(x, fmt=".1f", unit="%") -> str:
  return "n/a" if x is None else f"{x:{fmt}}{unit}"


def lines(name: str, s: dict, groups: tuple = ("by_chip", "by_source")) -> list:
  """Human-readable lines of one score: the model beside the baseline, overall, by chip and by source."""
  m, b = s["model"], s["baseline"]
  out = [f"{name}: {s['n']} rows | MAPE model {_f(m['mape_pct'])} vs baseline {_f(b['mape_pct'])} | mean signed "
         f"{_f(m['mean_signed_pct'], '+.1f')} vs {_f(b['mean_signed_pct'], '+.1f')} | Kendall tau global "
         f"{_f(m['tau_global'], '.2f', '')} vs {_f(b['tau_global'], '.2f', '')}, within tables "
         f"{_f(m['tau_tables'], '.2f', '')} vs {_f(b['tau_tables'], '.2f', '')}"]
  for group in groups:
    for k, v in m[group].items():
      out.append(f"  {group[3:]} {k[:90]}: {v['n']} rows | MAPE model {_f(v['mape_pct'])} vs baseline "
                 f"{_f(b[group][k]['mape_pct'])}")
  return out
