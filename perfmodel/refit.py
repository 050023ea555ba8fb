"""Refitting the step composition from a calibration's stored step times, without measuring them again.

* ``calibrate --refit-composition HLO_DIR`` (:func:`refit`): the learned composition, from the node samples
  file and the calibration programs' cached HLO;
* ``calibrate --profiled`` (:func:`fit_profiled`): the composition for the profiled backend: every
  calibration program's instructions timed alone (perfmodel/fusion_profiler.py), then the same typed fit;
  and the hybrid backend's (:func:`fit_hybrid`, perfmodel/hybrid.py) on the same database.

Both walk the programs the profile's ``calibration_loo`` lists (each with its measured step), price them
with the learned backend minus the program's own samples (leave one program out) or the profiled database,
and fit and cross-validate with ``calibrate_nodes.fit_typed`` / ``loo_typed``.
"""
from __future__ import annotations

import datetime
import json
import platform

import numpy as np

from framework.config import validate as validate_cfg
from perfmodel import calibrate_nodes as cn, capture, costs, graph as graph_lib, hardware, learned, suite


def _programs(hw, hlo_program, log):
  """(name, measured row of calibration_loo, graph, captured, decode region or None, power-of-two training step)
  of every calibration program the profile measured and ``hlo_program(name, compile_fn)`` can provide (None: left
  out)."""
  from perfmodel.validate import decode_loop  # noqa: PLC0415
  train = {e["name"]: e for e in suite.CALIBRATION}
  infer = {e["name"]: e for e in suite.CALIBRATION_INFER}
  for c in hw.calibration["calibration_loo"]:
    name = c["name"]
    if name in train:
      cfg = cn._cfg(train[name])
      cap, gen = hlo_program(name, lambda cfg=cfg: capture.train_step(cfg)), None
    elif name in infer:
      e = infer[name]
      cfg, gen = validate_cfg(cn._cfg_infer(e), 1), e["gen_lens"][1]
      cap = hlo_program(name, lambda cfg=cfg, e=e, gen=gen: capture.sampler(cfg, e["batch"], e["prompt_len"], gen))
    else:
      cap = None
    if cap is None:
      log(f"  refit: no program for {name}; left out")
      continue
    g = graph_lib.from_hlo_text(cap.hlo_text, cap.n_devices)
    region = decode_loop(g, gen).body if gen else None
    graph_lib.mark_decode(g, region)
    if gen is None:  # as run() does: a pipelined program's row sees the work that runs
      cn._resolve_branches(g, cfg, hw)
    yield name, c, g, cap, region, gen is None and cn.pow2_tokens(cfg)


def _fit(hw, programs: list, price_for, log, label: str) -> tuple:
  """(coefficients, leave-one-out rows) of the typed composition with node prices ``price_for(name, cap)``;
  ``programs``: the tuples of :func:`_programs`, parsed once and priced by every fit."""
  rows, y, types, names, noise = [], [], [], [], []
  for name, c, g, cap, region, pow2 in programs:
    price = price_for(name, cap)
    f = cn.composition_features(g, price, cap.n_devices, region, cap.memory.get("temp_size_in_bytes", 0.0), hw=hw,
                                pow2=pow2)
    if region:
      f[2] = 0.0
    rows.append(f)
    y.append(c["measured_s"])
    types.append(cn.program_type(cap.n_devices, bool(region)))
    names.append(name)
    noise.append(c.get("noise_pct", 0.0))
  coef = cn.fit_typed(rows, y, types)
  cv = cn.loo_typed(rows, y, types, names, noise)
  for c in cv:
    log(f"  LOO{label} {c['name']:>18} ({c['type']:>6}): measured {c['measured_s'] * 1e3:8.3f} ms predicted "
        f"{c['predicted_s'] * 1e3:8.3f} ms err {c['err_pct']:+6.1f}%")
  return coef, cv


def _store(prof_path: str, updates: dict) -> dict:
  with open(prof_path) as f:
    base = json.load(f)
  cal = base["calibration"]["value"]
  cal.update(updates)
  with open(prof_path, "w") as f:
    json.dump(base, f, indent=1)
  return cal


def _rounded(cv: list) -> list:
  return [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in c.items()} for c in cv]


def _samples(hw, samples_file=None) -> list:
  with open(samples_file or learned.samples_path(hw.name)) as f:
    return json.load(f)["samples"]


def _learned_without(hw, samples: list, name: str):
  return learned.Learned(hw, samples=[s for s in samples if s["prog"] != name])


def refresh_samples(samples: list, graphs: dict, sampler: set = frozenset()) -> tuple:
  """The stored node samples with class and features recomputed by this code (``learned.node_class`` /
  ``features``) from each program's graph ({program: ExecGraph}); the measured time, physical estimate and
  working set are kept. A sample whose node is missing or whose fingerprint changed is dropped: the program
  that was traced is not the one compiled now. A sample of a ``sampler`` program keeps the decode class
  (calibrate_nodes._node_samples). Returns (samples, dropped count)."""
  by_prog = {name: {n.name: n for n, _ in g.walk()} for name, g in graphs.items()}
  out, dropped = [], 0
  for s in samples:
    n = by_prog.get(s["prog"], {}).get(s.get("name"))
    if n is None or (s.get("fp") and s["fp"] not in (n.fingerprint, graph_lib.without_structure(n.fingerprint),
                                                     graph_lib.legacy_fingerprint(n.fingerprint))):
      dropped += 1
      continue
    cls = learned.base_class(n) + (learned.DECODE if s["prog"] in sampler else "")
    out.append({**s, "cls": cls, "f": learned.features(n), "fp": n.fingerprint})
  return out, dropped


def add_decode_context(samples: list, programs: dict) -> tuple:
  """Version-3 samples -> version 4: every sample of a sampler program (a program with a decode region, of
  ``programs`` {name: {region, ...}}) gets the decode class, as calibrate_nodes._node_samples labels a sampler
  program's samples. Returns (samples, how many are a sampler program's)."""
  sampler = {name for name, p in programs.items() if p.get("region")}
  out = [{**s, "cls": s["cls"] + learned.DECODE} if s["prog"] in sampler and not s["cls"].endswith(learned.DECODE)
         else s for s in samples]
  return out, sum(s["prog"] in sampler for s in samples)


def refit(prof_path: str, hlo_dir: str, log=print) -> dict:
  """Refits the learned backend from stored calibration data, nothing re-measured: the measured step times kept
  in the profile (``calibration_loo``) and the node samples file. Each calibration program is read from
  ``hlo_dir/<name>.json`` (as ``validate --hlo-cache`` writes them) or compiled and stored there; the samples'
  classes and features are recomputed by this code when another ``learned.FEATURES_VERSION`` wrote them (so such
  a change needs no new calibration; the same version keeps them as they are), then k, beta and the composition
  are chosen by leave-one-program-out error as ``calibrate`` does (calibrate_nodes.select_learned). Writes the samples file and the profile."""
  from perfmodel.validate import _cached_capture  # noqa: PLC0415
  hw = hardware.load(prof_path)
  spath = learned.samples_path(hw.name)
  with open(spath) as f:
    data = json.load(f)
  programs = []
  for name, c, g, cap, region, pow2 in _programs(hw, lambda name, fn: _cached_capture(hlo_dir, name, fn), log):
    programs.append({"name": name, "graph": g, "n": cap.n_devices, "measured": c["measured_s"],
                     "noise": c.get("noise_pct", 0.0), "region": region,
                     "temp": cap.memory.get("temp_size_in_bytes", 0.0), "pow2": pow2})
  version = data.get("meta", {}).get("features_version", 1)
  if version == 3:  # version 4 only adds the decode context: nothing needs re-deriving, nothing is dropped
    samples, marked = add_decode_context(data["samples"], {p["name"]: p for p in programs})
    log(f"  refit: {marked} of {len(samples)} node samples are a sampler program's (class{learned.DECODE})")
    dropped = 0
  elif version != learned.FEATURES_VERSION:
    samples, dropped = refresh_samples(data["samples"], {p["name"]: p["graph"] for p in programs},
                                       {p["name"] for p in programs if p["region"]})
    log(f"  refit: {len(samples)} node samples re-derived, {dropped} dropped (node gone or changed)")
  else:  # same features: re-deriving would only drop the samples of programs whose instruction names moved
    samples, dropped = data["samples"], 0
    log(f"  refit: {len(samples)} node samples of the current features version, kept as they are")
  res = cn.select_learned(hw, programs, samples, cn.allocator_keeps(hw), log)
  data["samples"] = samples
  data["meta"] = {**data.get("meta", {}), "features_version": learned.FEATURES_VERSION,
                  "refit": f"classes and features re-derived {datetime.datetime.now().isoformat(timespec='minutes')}"}
  with open(spath, "w") as f:
    json.dump(data, f)
  _store(prof_path, {"composition": res["composition"], "calibration_loo": _rounded(res["loo"]),
                     "calibration_loo_mape": res["loo_mape"],
                     **{key: res[key] for key in cn.LEARNED_CHOICES}})
  return {**res, "samples": len(samples), "dropped": dropped}


def fit_profiled(prof_path: str, hlo_cache: str = None, log=print, samples_file: str = None,
                 db: str = None) -> dict:
  """``calibrate --profiled``: the composition for node prices from the profiled database.

  Every calibration program kept in the profile (``calibration_loo``: its measured step) is compiled again
  (or read from ``hlo_cache``, as ``validate --hlo-cache`` stores programs), each of its compute instructions
  is cut out and timed alone (perfmodel/fusion_profiler.py, into the profiled database), and the same typed
  composition as the learned one is fitted on those prices, with its own leave-one-program-out error. Nodes
  the profiler leaves out are priced by the learned backend without the program's own samples, as
  ``--backend profiled`` prices them (costs.make_chain). Stored as ``composition_profiled`` beside the learned
  ``composition``. ``samples_file`` / ``db``: the learned samples and the profiled database (default: the
  profile's own)."""
  from perfmodel import fusion_profiler  # noqa: PLC0415
  from perfmodel.validate import _cached_capture  # noqa: PLC0415
  hw = hardware.load(prof_path)
  samples = _samples(hw, samples_file)
  skipped = {}
  profiled_date = datetime.datetime.now().isoformat(timespec="seconds")

  def price_for(name, cap):
    # the composition is fitted on these prices and this calibration's step times: every calibration program's
    # instructions are timed now (stale_before), so the ratios of the hybrid come from one sitting; entries of
    # validation programs timed before this are timed again when they are next used (fusion_profiler.stale_before)
    r = fusion_profiler.profile_program(cap.hlo_text, cap.n_devices, hw.name, path=db, stale_before=profiled_date)
    for k, v in r["skipped"].items():
      skipped[k] = skipped.get(k, 0) + v
    log(f"  profiled {name:>20}: {r['timed']} nodes timed alone, skipped {r['skipped'] or 'none'}")
    chain = costs.Chain([costs.Profiled(hw, db), _learned_without(hw, samples, name)], hw)
    return lambda n: chain.price(n).seconds
  programs = list(_programs(hw, lambda name, compile_fn: _cached_capture(hlo_cache, name, compile_fn), log))
  coef, cv = _fit(hw, programs, price_for, log, " profiled")
  mape = float(np.mean([abs(c["err_pct"]) for c in cv]))
  hyb = fit_hybrid(hw, programs, samples, costs.Profiled(hw, db), log)
  source = (f"python -m perfmodel calibrate --profiled on {platform.node()} "
            f"{datetime.datetime.now().isoformat(timespec='minutes')}: node times profiled then, step times from the "
            f"calibration of {hw.calibration.get('date', '?')} (a host state between the two is error of this "
            f"composition)")
  cal = _store(prof_path, {
      "composition_profiled": coef, "calibration_loo_profiled": _rounded(cv), "calibration_loo_profiled_mape": mape,
      "composition_profiled_source": source, "profiled_date": profiled_date,
      "composition_hybrid": hyb["composition"], "calibration_loo_hybrid": _rounded(hyb["loo"]),
      "calibration_loo_hybrid_mape": hyb["loo_mape"], **hyb["choices"],
      "composition_hybrid_source": source})
  return {"composition_profiled": coef, "loo_mape_profiled": mape, "loo_mape_learned": cal.get("calibration_loo_mape"),
          "loo_mape_hybrid": hyb["loo_mape"], **hyb["choices"],
          "loo_mape_hybrid_by_k": hyb["by_k"],
          "backend_auto": costs.resolve_backend(hardware.load(prof_path)), "skipped": skipped, "loo": cv}


def refit_hybrid(prof_path: str, hlo_cache: str = None, log=print) -> dict:
  """``calibrate --refit-hybrid``: the hybrid backend's composition and choices (:func:`fit_hybrid`) fitted again
  on what the calibration stored, nothing re-measured: its step times (``calibration_loo``), node samples and
  profiled database. For a change of the hybrid's pricing alone (as the program-bytes dimension of session 29):
  unlike ``--profiled``, no instruction is timed again, so the refit is the same data priced by the new code."""
  from perfmodel.validate import _cached_capture  # noqa: PLC0415
  hw = hardware.load(prof_path)
  if "composition_hybrid" not in hw.calibration:
    raise ValueError(f"{prof_path}: no hybrid composition to refit: run `python -m perfmodel calibrate --profiled`")
  programs = list(_programs(hw, lambda name, compile_fn: _cached_capture(hlo_cache, name, compile_fn), log))
  hyb = fit_hybrid(hw, programs, _samples(hw), costs.Profiled(hw), log)
  source = (f"{hw.calibration.get('composition_hybrid_source', '?')}; refit by python -m perfmodel calibrate "
            f"--refit-hybrid {datetime.datetime.now().isoformat(timespec='minutes')} (nothing re-measured)")
  _store(prof_path, {"composition_hybrid": hyb["composition"], "calibration_loo_hybrid": _rounded(hyb["loo"]),
                     "calibration_loo_hybrid_mape": hyb["loo_mape"], **hyb["choices"],
                     "composition_hybrid_source": source})
  return {"loo_mape_hybrid": hyb["loo_mape"], **hyb["choices"], "loo_mape_hybrid_by_k": hyb["by_k"],
          "backend_auto": costs.resolve_backend(hardware.load(prof_path))}


def fit_hybrid(hw, programs, samples: list, db, log=print, wp_grid=None, train_wp=None) -> dict:
  """The hybrid backend's composition (perfmodel/hybrid.py: profiled time x in-program/alone ratio of the
  nearest samples), for each neighbour count of ``hybrid.K_GRID`` and each statistic of the samples
  (``learned.STATS``). As ``select_learned`` chooses the learned backend's, the training and multi-device rows
  choose ``hybrid_k`` / ``hybrid_stat`` and the decode rows ``hybrid_k_decode`` / ``hybrid_stat_decode``
  (lowest leave-one-program-out error of each group; the types' fits are independent and a decode row prices
  only decode nodes, so the two choices do not interact), and with them the weight of the program-bytes dimension
  (``hybrid.WP_GRID`` or ``wp_grid``; ``hybrid_wp_decode``; the other rows choose among ``hybrid.WP_TRAIN`` or
  ``train_wp``: ``hybrid_wp``). Leaving a program out removes its own samples from
  the ratios and its row from the fit. Nodes without a database entry go to the learned backend without the
  program's samples, as ``--backend hybrid`` prices them (costs.make_chain)."""
  from perfmodel import hybrid  # noqa: PLC0415
  wp_grid = hybrid.WP_GRID if wp_grid is None else tuple(wp_grid)
  train_wp = hybrid.WP_TRAIN if train_wp is None else tuple(train_wp)
  runs, by_k = {}, {}
  decode_only = [p for p in programs if p[4]]
  wps = sorted(set(wp_grid) | set(train_wp))
  for k, stat, wp in [(k, st, wp) for k in hybrid.K_GRID for st in learned.stats_of(samples) for wp in wps
                      if wp in train_wp or decode_only]:
    def price_for(name, cap, k=k, stat=stat, wp=wp):
      rest = [s for s in samples if s["prog"] != name]
      chain = costs.Chain([hybrid.Hybrid(hw, rest, db, k, k, stat=stat, stat_decode=stat, wp=wp, wp_decode=wp),
                           learned.Learned(hw, samples=rest)], hw)
      return lambda n: chain.price(n).seconds
    # a weight the other rows may not choose prices only the decode programs (each type's fit is its own, so
    # their decode coefficients and errors are the same as with every program)
    coef, cv = _fit(hw, programs if wp in train_wp else decode_only, price_for, lambda *a: None, " hybrid")
    runs[(k, stat, wp)] = (coef, cv)
    label = f"{k} {stat}" + (f" wp{wp:g}" if wp else "") + ("" if wp in train_wp else " (decode programs)")
    by_k[label] = float(np.mean([abs(c["err_pct"]) for c in cv]))
    log(f"  hybrid k={k} {stat} wp={wp:g}: leave-one-program-out MAPE {by_k[label]:.2f}%")

  def group_mape(choice, decode):
    errs = [abs(c["err_pct"]) for c in runs[choice][1] if (c["type"] == "decode") == decode]
    return float(np.mean(errs)) if errs else 0.0
  best = min((ch for ch in runs if ch[2] in train_wp), key=lambda ch: group_mape(ch, False))
  best_dec = min([ch for ch in runs if ch[2] in wp_grid] or list(runs), key=lambda ch: group_mape(ch, True))
  coef = {t: (runs[best_dec] if t == "decode" else runs[best])[0][t] for t in runs[best][0]}
  cv = [c for c in runs[best][1] if c["type"] != "decode"] + [c for c in runs[best_dec][1] if c["type"] == "decode"]
  mape = float(np.mean([abs(c["err_pct"]) for c in cv]))
  log(f"  hybrid: k={best[0]} {best[1]} wp={best[2]:g}, decode k={best_dec[0]} {best_dec[1]} wp={best_dec[2]:g}: "
      f"leave-one-program-out MAPE {mape:.2f}%")
  for c in cv:
    log(f"  LOO hybrid {c['name']:>18} ({c['type']:>6}): measured {c['measured_s'] * 1e3:8.3f} ms predicted "
        f"{c['predicted_s'] * 1e3:8.3f} ms err {c['err_pct']:+6.1f}%")
  return {"composition": coef, "loo": cv, "loo_mape": mape, "by_k": by_k,
          "choices": {"hybrid_k": best[0], "hybrid_stat": best[1], "hybrid_wp": best[2],
                      "hybrid_k_decode": best_dec[0], "hybrid_stat_decode": best_dec[1], "hybrid_wp_decode": best_dec[2]}}
