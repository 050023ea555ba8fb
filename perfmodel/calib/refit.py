"""Refitting compositions from a calibration's stored step times, without measuring them again.

* ``calibrate --refit-composition HLO_DIR`` (:func:`refit`): the learned backend (sample classes and features
  re-derived when the features changed, k, beta, statistic, composition), from the node samples file and the
  calibration programs' cached HLO;
* ``calibrate --profiled`` (:func:`fit_profiled`): every calibration program's instructions timed alone into the
  committed profiled database (perfmodel/cost/profiler.py), then the profiled backend's composition and the
  hybrid's (:func:`fit_hybrid`) fitted on those prices;
* ``calibrate --refit-hybrid HLO_DIR`` (:func:`refit_hybrid`): the hybrid's choices and composition on the stored
  samples and database, nothing timed.

All walk the programs the profile's learned composition lists (each with its measured step), price them without
the program's own samples (leave one program out), and fit and cross-validate with perfmodel/calib/fit.py.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import platform

import numpy as np

from perfmodel import compose, hardware, program
from perfmodel.calib import fit, nodes, runners, store, suite
from perfmodel.cost import profiler
from perfmodel.compositions import Composition, Neighbours
from perfmodel.cost import chain as chain_lib
from perfmodel.cost import database, hybrid, learned
from perfmodel.graph.from_hlo import from_hlo_text
from perfmodel.graph.nodes import mark_decode

# neighbour counts tried for the hybrid backend (one chosen for decode nodes, one for the others)
HYBRID_K = (2, 4, 8, 16)
# weights of the program-bytes dimension the decode nodes may choose; one unit weighs as much as a factor e in any
# shape feature
WP_GRID = (0.0, 0.25, 0.5, 1.0, 2.0)
# ... and those the training and multi-device rows may choose: 0 only. A decode loop re-reads the same weights every
# token, so whether they stay in the caches depends on what the program moves; a training step streams each weight
# once per pass either way. Offered the grid, the training rows chose a weight that lowered their leave-one-out error
# and raised every stored validation set's training error: the restriction was chosen after seeing those sets.
WP_TRAIN = (0.0,)


def programs(hw, capture, log) -> list:
  """[(name, measured row, graph, captured, decode region or None, power-of-two training step)] of every calibration
  program the profile measured and ``capture(name, compile_fn)`` can provide (None: left out)."""
  train = {e["name"]: e for e in suite.CALIBRATION}
  infer = {e["name"]: e for e in suite.CALIBRATION_INFER}
  out = []
  for c in hw.calibration.compositions["learned"].loo:
    name = c["name"]
    cap, gen, cfg = None, None, None
    if name in train:
      cfg = runners.entry_cfg(train[name])[0]
      cap = capture(name, lambda cfg=cfg: program.train_step(cfg))
    elif name in infer:
      e = infer[name]
      cfg, gen = runners.entry_cfg(e)[0], e["gen_lens"][1]
      cap = capture(name, lambda cfg=cfg, e=e, gen=gen: program.sampler(cfg, e["batch"], e["prompt_len"], gen))
    if cap is None:
      log(f"  refit: no program for {name}; left out")
      continue
    g = from_hlo_text(cap.hlo_text, cap.n_devices)
    region = runners.decode_loop(g, gen).body if gen else None
    mark_decode(g, region)
    if gen is None:  # as calibration does: a pipelined program's row sees the work that runs
      nodes.resolve_branches(g, cfg, hw)
    out.append((name, c, g, cap, region, gen is None and compose.pow2_tokens(cfg)))
  return out


def _fit(hw, progs: list, price_for, log, label: str) -> Composition:
  """The typed composition with node prices ``price_for(name, cap)`` over ``progs`` (:func:`programs`)."""
  rows, y, types, names, noise = [], [], [], [], []
  for name, c, g, cap, region, pow2 in progs:
    p = {"graph": g, "n": cap.n_devices, "region": region, "temp": cap.memory.get("temp_size_in_bytes", 0.0),
         "pow2": pow2}
    rows.append(fit.program_row(p, price_for(name, cap), hw))
    y.append(c["measured_s"])
    types.append(compose.program_type(cap.n_devices, bool(region)))
    names.append(name)
    noise.append(c.get("noise_pct", 0.0))
  comp = fit.fit(rows, y, types, names, noise)
  for c in comp.loo:
    log(f"  LOO{label} {c['name']:>18} ({c['type']:>6}): measured {c['measured_s'] * 1e3:8.3f} ms predicted "
        f"{c['predicted_s'] * 1e3:8.3f} ms err {c['err_pct']:+6.1f}%")
  return comp


def _samples(hw, samples_file=None) -> list:
  return store.read_json(samples_file or learned.samples_path(hw.name))["samples"]


def _learned_without(hw, samples: list, name: str):
  return learned.Learned(hw, samples=[s for s in samples if s["prog"] != name])


def refresh_samples(samples: list, graphs: dict, sampler: set = frozenset()) -> tuple:
  """The stored node samples with class and features recomputed by this code (learned.base_class / features) from
  each program's graph ({program: ExecGraph}); the measured times, physical estimate and working set are kept. A
  sample whose node is missing or whose fingerprint changed is dropped: the program that was traced is not the one
  compiled now. A ``sampler`` program's samples keep the decode class. Returns (samples, dropped count)."""
  by_prog = {name: {n.name: n for n, _ in g.walk()} for name, g in graphs.items()}
  out, dropped = [], 0
  for s in samples:
    n = by_prog.get(s["prog"], {}).get(s.get("name"))
    if n is None or (s.get("fp") and s["fp"] != n.fingerprint):
      dropped += 1
      continue
    cls = learned.base_class(n) + (learned.DECODE if s["prog"] in sampler else "")
    out.append({**s, "cls": cls, "f": learned.features(n), "fp": n.fingerprint})
  return out, dropped


def refit(prof_path: str, hlo_dir: str, log=print) -> dict:
  """The learned backend refitted on stored data: the step times of the profile's learned composition and the node
  samples file; each calibration program read from ``hlo_dir/<name>.json`` (as ``validate --hlo-cache`` writes them)
  or compiled and stored there. Samples written by another ``learned.FEATURES_VERSION`` get their classes and
  features re-derived, then k, beta, statistic and composition are chosen as ``calibrate`` chooses them."""
  hw = hardware.load(prof_path)
  data = store.read_json(learned.samples_path(hw.name))
  progs = [{"name": name, "graph": g, "n": cap.n_devices, "measured": c["measured_s"], "noise": c.get("noise_pct", 0.0),
            "region": region, "temp": cap.memory.get("temp_size_in_bytes", 0.0), "pow2": pow2}
           for name, c, g, cap, region, pow2 in programs(hw, lambda n, fn: runners.cached_capture(hlo_dir, n, fn), log)]
  if data.get("meta", {}).get("features_version", 1) != learned.FEATURES_VERSION:
    samples, dropped = refresh_samples(data["samples"], {p["name"]: p["graph"] for p in progs},
                                       {p["name"] for p in progs if p["region"]})
    log(f"  refit: {len(samples)} node samples re-derived, {dropped} dropped (node gone or changed)")
  else:  # same features: re-deriving would only drop the samples of programs whose instruction names moved
    samples, dropped = data["samples"], 0
    log(f"  refit: {len(samples)} node samples of the current features version, kept as they are")
  res = fit.select_learned(hw, progs, samples, hw.calibration.host_malloc == "keep_freed", log)
  data["samples"] = samples
  data["meta"] = {**data.get("meta", {}), "features_version": learned.FEATURES_VERSION,
                  "refit": f"classes and features re-derived {datetime.datetime.now().isoformat(timespec='minutes')}"}
  store.write_json(database.calibration_db_path(database.samples_name(hw.name), os.path.dirname(prof_path)), data)
  comp = dataclasses.replace(res["composition"], source=hw.calibration.compositions["learned"].source)
  store.update_calibration(prof_path, compositions={**hw.calibration.compositions, "learned": comp},
                           neighbours={**hw.calibration.neighbours, "learned": res["neighbours"]})
  return {"composition": comp.to_dict()["forms"], "loo_mape": comp.loo_mape,
          "neighbours": {g: dataclasses.asdict(n) for g, n in res["neighbours"].items()}, "samples": len(samples),
          "dropped": dropped}


def fit_profiled(prof_path: str, hlo_cache: str = None, log=print, samples_file: str = None, db: str = None) -> dict:
  """``calibrate --profiled``: every calibration program's compute instructions timed alone (into ``db``, default
  the profiled database beside the profile ``prof_path``), then the profiled backend's composition on those prices, with its own
  leave-one-program-out error, and the hybrid's (:func:`fit_hybrid`). Nodes the profiler leaves out are priced by
  the learned backend without the program's own samples, as ``--backend profiled`` prices them."""
  hw = hardware.load(prof_path)
  samples = _samples(hw, samples_file)
  db = db or database.calibration_db_path(database.db_name(hw.name), os.path.dirname(prof_path))
  skipped = {}
  profiled_date = datetime.datetime.now().isoformat(timespec="seconds")

  def price_for(name, cap):
    # every calibration program's instructions are timed now (stale_before), so the hybrid's ratios come from one
    # sitting; entries of validation programs timed before this are timed again when they are next used
    r = profiler.profile_program(cap.hlo_text, cap.n_devices, hw.name, path=db, stale_before=profiled_date)
    for k, v in r["skipped"].items():
      skipped[k] = skipped.get(k, 0) + v
    log(f"  profiled {name:>20}: {r['timed']} nodes timed alone, skipped {r['skipped'] or 'none'}")
    chain = chain_lib.Chain([database.Profiled(hw, db), _learned_without(hw, samples, name)], hw)
    return lambda n: chain.price(n).seconds
  progs = programs(hw, lambda name, compile_fn: runners.cached_capture(hlo_cache, name, compile_fn), log)
  source = (f"python -m perfmodel calibrate --profiled on {platform.machine()} {os.cpu_count()}-core host "
            f"{datetime.datetime.now().isoformat(timespec='minutes')}: node times profiled then, step times from the "
            f"calibration of {hw.calibration.date or '?'}")
  comp = dataclasses.replace(_fit(hw, progs, price_for, log, " profiled"), source=source)
  hyb = fit_hybrid(hw, progs, samples, database.Profiled(hw, db), log)
  cal = store.update_calibration(
      prof_path, profiled_date=profiled_date,
      compositions={**hw.calibration.compositions, "profiled": comp,
                    "hybrid": dataclasses.replace(hyb["composition"], source=source)},
      neighbours={**hw.calibration.neighbours, "hybrid": hyb["neighbours"]})
  return {"loo_mape_profiled": comp.loo_mape, "loo_mape_learned": cal.compositions["learned"].loo_mape,
          "loo_mape_hybrid": hyb["composition"].loo_mape, "hybrid_loo_mape_by_choice": hyb["by_choice"],
          "backend_auto": chain_lib.resolve_backend(hardware.load(prof_path)), "skipped": skipped}


def refit_hybrid(prof_path: str, hlo_cache: str = None, log=print) -> dict:
  """``calibrate --refit-hybrid``: the hybrid's choices and composition fitted again on what the calibration
  stored (step times, node samples, profiled database), nothing timed: for a change of the hybrid's pricing alone."""
  hw = hardware.load(prof_path)
  if "hybrid" not in hw.calibration.compositions:
    raise ValueError(f"{prof_path}: no hybrid composition to refit: run `python -m perfmodel calibrate --profiled`")
  progs = programs(hw, lambda name, compile_fn: runners.cached_capture(hlo_cache, name, compile_fn), log)
  db = database.calibration_db_path(database.db_name(hw.name), os.path.dirname(prof_path))
  hyb = fit_hybrid(hw, progs, _samples(hw), database.Profiled(hw, db), log)
  old = hw.calibration.compositions["hybrid"].source
  comp = dataclasses.replace(hyb["composition"], source=f"{old}; refit by python -m perfmodel calibrate "
                             f"--refit-hybrid {datetime.datetime.now().isoformat(timespec='minutes')} (nothing timed)")
  store.update_calibration(prof_path, compositions={**hw.calibration.compositions, "hybrid": comp},
                           neighbours={**hw.calibration.neighbours, "hybrid": hyb["neighbours"]})
  return {"loo_mape_hybrid": comp.loo_mape, "hybrid_loo_mape_by_choice": hyb["by_choice"],
          "neighbours": {g: dataclasses.asdict(n) for g, n in hyb["neighbours"].items()},
          "backend_auto": chain_lib.resolve_backend(hardware.load(prof_path))}


def fit_hybrid(hw, progs, samples: list, db, log=print, wp_grid=None, train_wp=None) -> dict:
  """The hybrid backend's composition for each neighbour count (HYBRID_K), sample statistic (learned.STATS) and
  program-bytes weight (``wp_grid`` for decode nodes, ``train_wp`` for the others): the training and multi-device
  rows choose theirs and the decode rows theirs (lowest leave-one-program-out error of each group; the types' fits
  are independent and a decode row prices only decode nodes, so the two choices do not interact). Leaving a program
  out removes its own samples from the ratios and its row from the fit; nodes without a database entry go to the
  learned backend without the program's samples, as ``--backend hybrid`` prices them.
  Returns {"composition", "neighbours", "by_choice"}."""
  wp_grid = WP_GRID if wp_grid is None else tuple(wp_grid)
  train_wp = WP_TRAIN if train_wp is None else tuple(train_wp)
  runs, by_choice = {}, {}
  decode_only = [p for p in progs if p[4]]
  wps = sorted(set(wp_grid) | set(train_wp))
  for k, stat, wp in [(k, st, wp) for k in HYBRID_K for st in learned.stats_of(samples) for wp in wps
                      if wp in train_wp or decode_only]:
    def price_for(name, cap, k=k, stat=stat, wp=wp):
      rest = [s for s in samples if s["prog"] != name]
      chain = chain_lib.Chain([hybrid.Hybrid(hw, rest, db, k, k, stat=stat, stat_decode=stat, wp=wp, wp_decode=wp),
                               learned.Learned(hw, samples=rest)], hw)
      return lambda n: chain.price(n).seconds
    # a weight the other rows may not choose prices only the decode programs (each type's fit is its own, so their
    # decode coefficients and errors are the same as with every program)
    comp = _fit(hw, progs if wp in train_wp else decode_only, price_for, lambda *a: None, " hybrid")
    runs[(k, stat, wp)] = comp
    label = f"{k} {stat}" + (f" wp{wp:g}" if wp else "") + ("" if wp in train_wp else " (decode programs)")
    by_choice[label] = comp.loo_mape
    log(f"  hybrid k={k} {stat} wp={wp:g}: leave-one-program-out MAPE {comp.loo_mape:.2f}%")

  def group_mape(choice, decode):
    errs = [abs(c["err_pct"]) for c in runs[choice].loo if (c["type"] == "decode") == decode]
    return float(np.mean(errs)) if errs else 0.0
  best = min((ch for ch in runs if ch[2] in train_wp), key=lambda ch: group_mape(ch, False))
  best_dec = min([ch for ch in runs if ch[2] in wp_grid] or list(runs), key=lambda ch: group_mape(ch, True))
  forms = {t: (runs[best_dec] if t == "decode" else runs[best]).forms[t] for t in runs[best].forms}
  loo = tuple([c for c in runs[best].loo if c["type"] != "decode"] + [c for c in runs[best_dec].loo
                                                                      if c["type"] == "decode"])
  comp = Composition(forms=forms, loo=loo, loo_mape=float(np.mean([abs(c["err_pct"]) for c in loo])))
  log(f"  hybrid: k={best[0]} {best[1]} wp={best[2]:g}, decode k={best_dec[0]} {best_dec[1]} wp={best_dec[2]:g}: "
      f"leave-one-program-out MAPE {comp.loo_mape:.2f}%")
  return {"composition": comp, "by_choice": by_choice,
          "neighbours": {"train": Neighbours(k=best[0], stat=best[1], wp=best[2]),
                         "decode": Neighbours(k=best_dec[0], stat=best_dec[1], wp=best_dec[2])}}
