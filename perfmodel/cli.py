"""Command line of the performance model. Parses flags and sets XLA's device count *before* jax starts."""
from __future__ import annotations

import argparse
import json
import math
import sys

COMPILE_MAX_DEVICES = 512  # above this, `--method auto` uses the analytic graph (see README: scale limits)


def _load_cfg(config: str, overrides: list, mesh: str = "", devices: int = 0):
  from framework.config import MESH_AXES, validate
  from framework.config_file import load
  ov = list(overrides)
  if mesh:
    sizes = dict(kv.split("=") for kv in mesh.split(","))
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
      raise SystemExit(f"--mesh axis {sorted(unknown)} unknown; axes are {MESH_AXES}")
    for a in MESH_AXES:
      ov.append(f"--config.mesh.{a}={int(sizes.get(a, 1))}")
  cfg = load(config, ov)
  n = devices or math.prod(abs(v) for v in cfg.mesh.sizes().values())
  return validate(cfg, n), n


def _print(obj):
  print(json.dumps(obj, indent=None, default=float))


def cmd_predict(a, overrides):
  from perfmodel import capture
  cfg, n = _load_cfg(a.config, overrides, a.mesh, a.devices)
  method = a.method
  if a.mode == "train" and method == "auto":
    method = "compile" if n <= COMPILE_MAX_DEVICES else "auto_large"
  if method == "compile" or a.mode == "infer":
    capture.ensure_devices(n if a.mode == "train" else 1)
  from perfmodel import hardware, predict
  hw = hardware.load(a.hardware)
  if a.mode == "infer":
    cap = capture.sampler(cfg, a.batch, a.prompt_len, a.gen_len)
    _profile(a, cap, hw)
    out = predict.predict_infer(cfg, hw, a.batch, a.prompt_len, a.gen_len, a.backend, captured=cap)
  elif method == "rank_program" or (method == "auto_large"):
    try:
      out = predict.predict_train_rank_program(cfg, hw, a.backend)
    except Exception as e:  # noqa: BLE001 (any failure of the traced route falls back, and says why)
      if method == "rank_program":
        raise
      out = predict.predict_train_analytic(cfg, hw, a.backend)
      out["route"] = "analytic"
      out["route_fallback_reason"] = f"rank_program route failed: {type(e).__name__}: {str(e)[:300]}"
  elif method == "analytic":
    out = predict.predict_train_analytic(cfg, hw, a.backend)
    out["route"] = "analytic"
  else:
    cap = capture.train_step(cfg)
    _profile(a, cap, hw)
    out = predict.predict_train(cfg, hw, a.backend, captured=cap)
    out["method"] = out["route"] = "compile"
  if not a.no_anchor:
    from perfmodel import anchor  # noqa: PLC0415
    out = anchor.apply(out, hw)
  _print(out)


def _profile(a, cap, hw):
  """--profile-dots / --profile-nodes: fill the profiled database with this program's nodes first. Also when
  ``auto`` resolves to the profiled backend for this profile (costs.resolve_backend): its prices are the
  program's own instructions timed alone (2-20 s the first time a program is seen; cached by fingerprint)."""
  from perfmodel import costs  # noqa: PLC0415
  profile = hw.name
  if a.profile_nodes or costs.resolve_backend(hw, a.backend) in costs.NEEDS_PROFILED_PROGRAM:
    from perfmodel import fusion_profiler
    r = fusion_profiler.profile_program(cap.hlo_text, cap.n_devices, profile,
                                        stale_before=fusion_profiler.stale_before(hw))
    print(json.dumps({"profiled_nodes": {k: v for k, v in r.items() if k != "seconds"}}), file=sys.stderr)
  elif a.profile_dots:
    from perfmodel import graph, profiler
    r = profiler.profile_dots(graph.from_hlo_text(cap.hlo_text), profile)
    print(json.dumps({"profiled_dots": r}), file=sys.stderr)


def _regime(a, trace: bool = True):
  """The measurement regime (perfmodel/bench.py): one pinned core, single-threaded XLA, CPU-time clock.
  Set before jax starts; calibration and validation must share it so predictions and measurements are in
  the same units. TraceMe is compiled in for both (calibration reads it; validation keeps the same code)."""
  from framework import host_memory
  from perfmodel import bench, trace_nodes
  host_memory.apply()  # the real job's allocator regime (experiments.run applies it too)
  if trace:
    trace_nodes.enable()
  if not a.no_pin:
    bench.pin(a.pin_core)


VALIDATE_DEVICES = 8  # virtual host devices in calibrate and validate processes (see cmd_calibrate)


def cmd_calibrate(a, overrides):
  from perfmodel import capture
  if a.anchor:
    _regime(a, trace=False)  # the calibration's regime (pinned core, CPU-time clock), as its step times were taken
    from perfmodel import anchor  # noqa: PLC0415
    rec = anchor.measure("cpu", rounds=a.step_rounds or 2)
    anchor.store(rec, anchor.profile_path("cpu"))
    _print({"speed_anchor": rec})
    return
  if a.refit_composition:
    capture.ensure_devices(VALIDATE_DEVICES)  # the multi-device calibration programs compile on virtual devices
    import os
    from perfmodel import hardware, refit
    res = refit.refit(os.path.join(hardware.PROFILE_DIR, "cpu.json"), a.refit_composition,
                                log=lambda m: print(m, file=sys.stderr))
    from perfmodel.calibrate_nodes import LEARNED_CHOICES
    _print({k: res[k] for k in ("composition", "loo_mape", *LEARNED_CHOICES, "samples", "dropped")})
    return
  if a.refit_hybrid:
    capture.ensure_devices(VALIDATE_DEVICES)
    import os
    from perfmodel import hardware, refit
    _print(refit.refit_hybrid(os.path.join(hardware.PROFILE_DIR, "cpu.json"), a.refit_hybrid,
                              log=lambda m: print(m, file=sys.stderr)))
    return
  if a.profiled:
    _regime(a, trace=False)
    capture.ensure_devices(VALIDATE_DEVICES)
    import os
    from perfmodel import hardware, refit
    res = refit.fit_profiled(os.path.join(hardware.PROFILE_DIR, "cpu.json"), a.hlo_cache,
                                       log=lambda m: print(m, file=sys.stderr))
    _print({k: v for k, v in res.items() if k != "loo"})
    return
  _regime(a)
  # This process compiles every calibration program (up to 4 devices); the step times are measured in children
  # with exactly each program's device count, as `validate` and `experiments.run` run them (the count changes a
  # one-device step's time: base 1.23-1.45x slower with 8 host devices than with 1).
  capture.ensure_devices(VALIDATE_DEVICES)
  import os
  from perfmodel import calibrate, hardware, learned
  prof = os.path.join(hardware.PROFILE_DIR, "cpu.json")
  snap = calibrate.snapshot([prof, learned.samples_path("cpu")])
  res = calibrate.run(quick=a.quick, nodes=not a.no_nodes, nodes_only=a.nodes_only,
                      step_rounds=a.step_rounds or calibrate.STEP_ROUNDS, step_statistic=a.step_statistic)
  nodes = res.get("nodes") or {}
  res["gate"] = calibrate.gate(snap, None if a.quick else nodes.get("loo_mape"),
                              calibrate.MAX_LOO_PCT if a.max_loo is None else a.max_loo)
  if res["gate"]["accepted"] and nodes and not (a.quick or a.no_profiled):
    # the profiled and hybrid compositions, fitted on this calibration's step times (calibrate --profiled)
    from perfmodel import refit  # noqa: PLC0415
    fit = refit.fit_profiled(prof, a.hlo_cache, log=lambda m: print(m, file=sys.stderr))
    res["profiled"] = {k: v for k, v in fit.items() if k != "loo"}
  _print(res)
  if not res["gate"]["accepted"]:
    print(res["gate"]["message"], file=sys.stderr)
    sys.exit(2)


def cmd_validate(a, overrides):
  from perfmodel import capture
  _regime(a)
  capture.ensure_devices(VALIDATE_DEVICES)
  from perfmodel import validate
  _print(validate.run(a.suite, reps=a.reps, backend=a.backend, png=a.png, results=not a.no_results,
                      limit=a.limit, measurements=a.measurements, hlo_cache=a.hlo_cache,
                      probe=not a.no_probe, isolate=not a.in_process, rounds=a.rounds,
                      anchors=not a.no_anchors))


def cmd_search(a, overrides):
  from framework.config_file import load
  cfg = load(a.config, list(overrides))  # the config's own mesh need not match --devices
  from perfmodel import capture
  if a.run_top:
    _regime(a)
    capture.ensure_devices(a.devices)
  from perfmodel import hardware, search
  _print(search.run(cfg, hardware.load(a.hardware), a.devices, top=a.top, run_top=a.run_top, backend=a.backend,
                    config_path=a.config, overrides=overrides, refine=a.refine))


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["emulate"]:
    # Emulation (perfmodel/emulate/, its own engineer) owns its flags; hand the rest of argv over untouched.
    from perfmodel.emulate import cli as emulate_cli
    return emulate_cli.main(argv[1:])
  p = argparse.ArgumentParser(prog="python -m perfmodel")
  sub = p.add_subparsers(dest="cmd", required=True)
  sub.add_parser("emulate", help="emulate a step at the target scale (see perfmodel/emulate/README.md)")
  pr = sub.add_parser("predict", help="predict step time / tokens/s / MFU / memory (or TTFT/TPOT)")
  pr.add_argument("--config", required=True)
  pr.add_argument("--hardware", default="cpu")
  pr.add_argument("--mesh", default="", help="e.g. data=2,tensor=4 (axes not named are 1)")
  pr.add_argument("--devices", type=int, default=0, help="device count when the mesh has a -1 axis")
  pr.add_argument("--mode", choices=("train", "infer"), default="train")
  pr.add_argument("--method", choices=("auto", "compile", "rank_program", "analytic"), default="auto",
                  help="auto: compile the real N-device program up to 512 devices, else the traced per-rank "
                       "program (rank_program), else the analytic graph")
  pr.add_argument("--backend", choices=("auto", "roofline", "calibrated", "profiled", "learned", "hybrid"),
                  default="auto")
  pr.add_argument("--profile-dots", action="store_true", help="time this program's unique dots on this host first")
  pr.add_argument("--profile-nodes", action="store_true",
                  help="time every compute instruction of this program alone on this host first (dots and fusions; "
                       "perfmodel/fusion_profiler.py); use with --backend profiled")
  pr.add_argument("--no-anchor", action="store_true",
                  help="ignore the profile's speed anchor (`calibrate --anchor`): times at the calibration's speed")
  pr.add_argument("--batch", type=int, default=1)
  pr.add_argument("--prompt-len", type=int, default=32)
  pr.add_argument("--gen-len", type=int, default=32)
  ca = sub.add_parser("calibrate", help="fit the cpu profile on this host (a few minutes)")
  ca.add_argument("--quick", action="store_true")
  ca.add_argument("--anchor", action="store_true",
                  help="only re-read the host's speed against the last calibration (suite.ANCHORS, about a minute; "
                       "perfmodel/anchor.py): `predict` then scales its times by it")
  ca.add_argument("--no-nodes", action="store_true", help="micro-benchmarks only (skip the learned backend)")
  ca.add_argument("--nodes-only", action="store_true", help="only the calibration-program stage (keep the curves)")
  ca.add_argument("--max-loo", type=float, default=None, metavar="PCT",
                  help="refuse (keep the previous profile) when the calibration's leave-one-program-out error is "
                       "above this (default 15; perfmodel/calibrate.py MAX_LOO_PCT)")
  ca.add_argument("--no-profiled", action="store_true",
                  help="skip the profiled / hybrid compositions at the end (run calibrate --profiled later)")
  ca.add_argument("--step-rounds", type=int, default=None,
                  help="rounds of the calibration programs' step measurement, pooled by median (default "
                       "calibrate.STEP_ROUNDS = 3; about 11 minutes each here)")
  ca.add_argument("--step-statistic", choices=("median", "p10"), default="p10",
                  help="which reading of the calibration programs' step times the composition is fitted on (default "
                       "p10: the 10th percentile of the timed calls, the least-contended speed of a shared host; "
                       "perfmodel/README.md, 'Which statistic a step time is'); validate reads in the same one")
  ca.add_argument("--profiled", action="store_true",
                  help="after a calibration: time the calibration programs' instructions alone (profiled database) "
                       "and fit the composition for --backend profiled, with its own leave-one-out error")
  ca.add_argument("--hlo-cache", default=None, help="with --profiled: folder of compiled programs (reused / filled)")
  ca.add_argument("--refit-composition", default="", metavar="HLO_DIR",
                  help="refit the learned backend (sample classes and features, k, beta, composition) from the stored "
                       "measurements, nothing re-measured; calibration programs read from / compiled into HLO_DIR")
  ca.add_argument("--refit-hybrid", default="", metavar="HLO_DIR",
                  help="refit the hybrid backend's composition and choices (k, statistic, program-bytes weight) from "
                       "the stored samples, profiled database and step times, nothing re-measured")
  va = sub.add_parser("validate", help="measured vs predicted over a suite of configs on this host")
  va.add_argument("--suite", default=None, help="python file with SUITE = [...] (default: perfmodel/suite.py)")
  va.add_argument("--reps", type=int, default=7)
  va.add_argument("--backend", default="auto")
  va.add_argument("--png", default="benchmarks/perfmodel_validate.png")
  va.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
  va.add_argument("--limit", type=int, default=0, help="run only the first N configs (smoke)")
  va.add_argument("--measurements", default=None, nargs="+", metavar="FILE",
                  help="JSON cache of measured times by config name: reused if present, filled if not; several "
                       "files: their rounds pooled (read only)")
  va.add_argument("--rounds", type=int, default=2,
                  help="measure the whole suite this many times; each config = median over rounds (host drift)")
  va.add_argument("--hlo-cache", default=None, help="folder of compiled programs by config name (reused / filled)")
  va.add_argument("--no-probe", action="store_true",
                  help="do not time the host-speed probe around measurements (perfmodel/speed.py): raw errors only")
  va.add_argument("--in-process", action="store_true",
                  help="measure in this process (8 host devices) instead of one child per device count")
  va.add_argument("--no-anchors", action="store_true",
                  help="do not re-measure the calibration's anchor programs (suite.ANCHORS) in each round")
  se = sub.add_parser("search", help="rank layouts for a model on N devices under memory limits")
  se.add_argument("--config", required=True)
  se.add_argument("--hardware", default="cpu")
  se.add_argument("--devices", type=int, required=True)
  se.add_argument("--top", type=int, default=10)
  se.add_argument("--backend", default="auto")
  se.add_argument("--run-top", action="store_true",
                  help="on this host: re-rank the top --refine layouts with compiled predictions, run them and the "
                       "default, report whether the predicted best beats the default")
  se.add_argument("--refine", type=int, default=4)
  for sp in (ca, va, se):
    sp.add_argument("--no-pin", action="store_true", help="measure unpinned in wall time (noisy on a shared host)")
    sp.add_argument("--pin-core", type=int, default=-1, help="core to pin to (default: the last allowed)")
  a, rest = p.parse_known_args(argv)
  bad = [r for r in rest if not r.startswith("--config.")]
  if bad:
    p.error(f"unrecognized arguments: {bad}")
  {"predict": cmd_predict, "calibrate": cmd_calibrate, "validate": cmd_validate, "search": cmd_search}[a.cmd](a, rest)
  return 0
