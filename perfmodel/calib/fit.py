"""Fitting a step composition, and the learned backend's choices, by leave-one-program-out error.

A composition (perfmodel/compositions.py) says how a backend's node prices add up to a step, per program type. Its
coefficients are fitted by non-negative least squares on the calibration programs' measured steps, with every
program's nodes priced *without that program's own samples*, so the interpolation error of the backend is part of
what the fit sees, and each choice below is judged by the leave-one-program-out error of the whole fit (never by a
validation set). Which terms a type may use is fixed here: the types have few calibration programs, so the forms stay
small.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from perfmodel import compose
from perfmodel.compositions import TERMS, Composition, Form, Neighbours, StepFeatures
from perfmodel.cost import learned

TYPE_TERMS = {
    "train": ("node_seconds", "node_executions", "devices", "fresh_temp_bytes", "pow2_node_seconds"),
    "multi": ("node_seconds", "collective_seconds", "fresh_temp_bytes"),
    "decode": ("node_seconds", "node_executions", "node_bytes", "node_bytes_beyond_knee"),
}
# Terms whose coefficient may be negative (all others are non-negative). A decode step's thunks are tiny (0.1-3 us)
# and each traced sample carries the TraceMe's own cost, so a decode loop's node sum overstates its work by a fixed
# amount per thunk: the fit takes it back with a negative per-thunk term. Offered the same signed term, the training
# type's leave-one-out error got worse, so only decode has it.
SIGNED = {"decode": ("node_executions",)}
# Terms a type keeps only where they lower its own leave-one-out error (chosen inside every fit, so the
# leave-one-program-out error of the whole fit includes the choice).
OPTIONAL = {"train": ("pow2_node_seconds",)}
# Terms a type takes from another when none of its own calibration programs can fit them: the power-of-two term
# belongs to XLA:CPU's kernels at power-of-two extents, not to the device count, but no multi-device calibration
# program is a power-of-two step, so the multi type borrows the training type's.
BORROWED = {"multi": ("train", ("pow2_node_seconds",))}
# A decode step streams its weights and KV cache; its time per byte grows as the step falls out of the core's
# caches (26 ps/B at 1.7 MB to 47 ps/B at 40+ MB on a CPU host), so decode prices bytes piecewise around a knee
# picked from this grid by the decode programs' own leave-one-out error.
KNEES = tuple(float(k) * 2 ** 20 for k in (1, 2, 3, 4, 6, 8, 12, 16))
LEARNED_K = (4, 8, 16)  # neighbour counts tried for the learned backend
LEARNED_BETA = (0.0, 0.1, 0.15, 0.2, 0.25, 0.3)  # working-set exponents tried (0: none)


def _vec(f: StepFeatures, knee=None) -> list:
  return [v for _, v in f.terms(knee)]


def _nnls(rows, y):
  A = np.array(rows, dtype=float)
  y = np.array(y, dtype=float)
  # relative error matters (steps span 1 ms .. 1 s): weight rows by 1/y
  w = 1.0 / y
  scale = np.maximum(np.abs(A * w[:, None]).max(axis=0), 1e-30)
  x, _ = nnls(A * w[:, None] / scale, np.ones_like(y))
  return x / scale


def _fit_terms(rows: list, y: list, terms: tuple, knee=None, signed=()) -> Form:
  """Least squares over ``terms``, non-negative except the ``signed`` ones (fitted as a positive and a negated copy
  whose coefficients are subtracted)."""
  cols = [TERMS.index(t) for t in terms]
  neg = [c for c in cols if TERMS[c] in signed]
  split = [_vec(r, knee) for r in rows]
  x = _nnls([[f[c] for c in cols] + [-f[c] for c in neg] for f in split], y)
  full = [0.0] * len(TERMS)
  for c, v in zip(cols, x):
    full[c] = float(v)
  for c, v in zip(neg, x[len(cols):]):
    full[c] -= float(v)
  return Form(coef=dict(zip(TERMS, full)), knee=knee or None)


def _loo_err(rows, y, terms, knee, signed) -> float:
  return float(np.mean([abs(_fit_terms(rows[:i] + rows[i + 1:], y[:i] + y[i + 1:], terms, knee, signed)
                            .seconds(rows[i]) / y[i] - 1) for i in range(len(rows))]))


def _pick_knee(rows, y, terms, signed=()):
  """The knee with the lowest leave-one-out error over these rows (all knees tie below 3 rows)."""
  if len(rows) < 3:
    return KNEES[len(KNEES) // 2]
  best = None
  for knee in KNEES:
    err = _loo_err(rows, y, terms, knee, signed)
    if best is None or err < best[0]:
      best = (err, knee)
  return best[1]


def _pick_optional(rows, y, terms, optional, knee=None, signed=()) -> tuple:
  """``terms`` with or without its ``optional`` ones, whichever has the lower leave-one-out error over these rows
  (a tie, too few rows, or an all-zero optional term: without)."""
  opt = tuple(t for t in optional if t in terms)
  base = tuple(t for t in terms if t not in opt)
  if not opt or len(rows) < 4 or not any(dict(r.terms(knee))[t] for r in rows for t in opt):
    return base
  return terms if _loo_err(rows, y, terms, knee, signed) < _loo_err(rows, y, base, knee, signed) else base


def fit_typed(rows: list, y: list, types: list) -> dict:
  """{program type: Form}: per type, NNLS over the type's terms; a type without rows takes the training form. A
  type with the split bytes term also gets its knee, and a type with ``OPTIONAL`` terms keeps or drops them, both
  chosen by leave-one-out over its own rows."""
  out = {}
  for t, terms in TYPE_TERMS.items():
    idx = [i for i, tt in enumerate(types) if tt == t]
    if not idx:
      continue
    sub, ys = [rows[i] for i in idx], [y[i] for i in idx]
    signed = SIGNED.get(t, ())
    knee = _pick_knee(sub, ys, terms, signed) if "node_bytes_beyond_knee" in terms else None
    terms = _pick_optional(sub, ys, terms, OPTIONAL.get(t, ()), knee, signed)
    out[t] = _fit_terms(sub, ys, terms, knee, signed)
  for t in TYPE_TERMS:
    out.setdefault(t, out.get("train", Form(coef={"node_seconds": 1.0})))
  for t, (src, terms) in BORROWED.items():  # only where the type's own rows leave the term empty
    own = [rows[i] for i, tt in enumerate(types) if tt == t]
    for term in terms:
      if not any(getattr(r, term) for r in own):
        out[t] = Form(coef={**out[t].coef, term: out[src].coef.get(term, 0.0)}, knee=out[t].knee)
  return out


def loo_typed(rows: list, y: list, types: list, names: list, noise: list) -> list:
  """One row per program: its step predicted by the fit on all the other programs."""
  cv = []
  for i in range(len(rows)):
    keep = [j for j in range(len(rows)) if j != i]
    forms = fit_typed([rows[j] for j in keep], [y[j] for j in keep], [types[j] for j in keep])
    p = forms[types[i]].seconds(rows[i])
    cv.append({"name": names[i], "type": types[i], "measured_s": y[i], "predicted_s": p,
               "err_pct": 100 * (p - y[i]) / y[i], "noise_pct": noise[i]})
  return cv


def fit(rows: list, y: list, types: list, names: list, noise: list, source: str = "") -> Composition:
  """The composition over these programs' rows, with its leave-one-program-out error."""
  cv = loo_typed(rows, y, types, names, noise)
  return Composition(forms=fit_typed(rows, y, types), loo_mape=float(np.mean([abs(c["err_pct"]) for c in cv])),
                     loo=tuple(cv), source=source)


def program_row(p: dict, price, hw, keeps=None) -> StepFeatures:
  """A calibration program's features ({graph, n[, region, temp, pow2]}: perfmodel/calib/nodes.py) with its nodes
  priced by ``price``; a decode program's row is one decode step (its loop body, no per-step constant)."""
  return compose.step_features(p["graph"], price, p["n"], p.get("region"), p.get("temp", 0.0), hw=hw, keeps=keeps,
                               pow2=p.get("pow2", False), per_step=not p.get("region"))


def select_learned(hw, programs: list, samples: list, keeps: bool, log=print) -> dict:
  """The learned backend's neighbour choices and its composition, by leave-one-program-out error over the
  calibration ``programs`` ({name, graph, n, measured, noise[, region, temp, pow2]}): each program's nodes priced
  without its own samples, the typed composition fitted and cross-validated for every (k, beta, statistic). Decode
  nodes have their own classes, so a decode program's row depends only on the decode choice and each type's fit
  only on its own rows: the decode choice is made by the decode programs' error, the other by the others'.
  Returns {"composition", "neighbours": {"train", "decode"}}."""
  grid = {}
  types = [compose.program_type(p["n"], bool(p.get("region"))) for p in programs]
  names, noise, y = [p["name"] for p in programs], [p["noise"] for p in programs], [p["measured"] for p in programs]
  for k, beta, stat in [(k, b, st) for k in LEARNED_K for b in LEARNED_BETA for st in learned.stats_of(samples)]:
    rows = []
    for p in programs:
      model = learned.Learned(hw, k=k, beta=beta, k_decode=k, beta_decode=beta, stat=stat, stat_decode=stat,
                              samples=[s for s in samples if s["prog"] != p["name"]])
      rows.append(program_row(p, lambda n: model.price(n).seconds, hw, keeps))
    cv = loo_typed(rows, y, types, names, noise)
    dec = [abs(c["err_pct"]) for c in cv if c["type"] == "decode"]
    rest = [abs(c["err_pct"]) for c in cv if c["type"] != "decode"]
    grid[(k, beta, stat)] = (rows, float(np.mean(rest)) if rest else 0.0, float(np.mean(dec)) if dec else 0.0)
    log(f"  learned k={k} beta={beta} {stat}: leave-one-program-out MAPE "
        f"{np.mean([abs(c['err_pct']) for c in cv]):.1f}% (decode {grid[(k, beta, stat)][2]:.1f}%, others "
        f"{grid[(k, beta, stat)][1]:.1f}%)")
  best = min(grid, key=lambda kb: grid[kb][1])
  best_dec = min(grid, key=lambda kb: grid[kb][2])
  rows = [grid[best_dec if t == "decode" else best][0][i] for i, t in enumerate(types)]
  comp = fit(rows, y, types, names, noise)
  for c in comp.loo:
    log(f"  LOO {c['name']:>18}: measured {c['measured_s'] * 1e3:8.2f} ms predicted {c['predicted_s'] * 1e3:8.2f} ms "
        f"err {c['err_pct']:+6.1f}%")
  log(f"  learned: k={best[0]} beta={best[1]} {best[2]}, decode k={best_dec[0]} beta={best_dec[1]} {best_dec[2]}: "
      f"leave-one-program-out MAPE {comp.loo_mape:.1f}%")
  return {"composition": comp,
          "neighbours": {"train": Neighbours(k=best[0], beta=best[1], stat=best[2]),
                         "decode": Neighbours(k=best_dec[0], beta=best_dec[1], stat=best_dec[2])}}
