"""Command line of the performance model: python -m perfmodel predict|validate|search|calibrate|emulate.

XLA reads its flags (the virtual device count, the measurement regime, per-thunk tracing) when jax starts its
backend, so each command sets them first and imports what runs on jax afterwards, inside the command.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile

from framework import host_memory
from framework.config import MESH_AXES, ConfigError, validate
from framework.config_file import load
from perfmodel import hardware
from perfmodel.calib import suite
from perfmodel.cost import regime
from perfmodel.emulate import cli as emulate_cli
from perfmodel.emulate import trace

VALIDATE_DEVICES = 8  # virtual host devices of calibrate and validate processes (measuring children have their own)


def _mesh_overrides(overrides: list, mesh: str = "") -> list:
  ov = list(overrides)
  if mesh:
    sizes = dict(kv.split("=") for kv in mesh.split(","))
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
      raise SystemExit(f"--mesh axis {sorted(unknown)} unknown; axes are {MESH_AXES}")
    for a in MESH_AXES:
      ov.append(f"--config.mesh.{a}={int(sizes.get(a, 1))}")
  return ov


def _print(obj):
  print(json.dumps(obj, indent=None, default=float))


def _log(msg):
  print(msg, file=sys.stderr, flush=True)


def _expert_load(path: str) -> list:
  """Layers x experts counts from a metrics.jsonl (its last record with expert_load) or a JSON list."""
  if not os.path.isfile(path):
    raise SystemExit(f"--expert-load {path}: no such file; pass a run's metrics.jsonl or a JSON layers x experts list")
  with open(path) as f:
    text = f.read()
  try:
    if path.endswith(".jsonl"):
      recs = [json.loads(x) for x in text.splitlines() if x.strip()]
      loads = [r["expert_load"] for r in recs if "expert_load" in r]
      if not loads:
        raise SystemExit(f"--expert-load {path}: no record with expert_load (a mixture-of-experts run writes it "
                         f"at every log step)")
      return loads[-1]
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise SystemExit(f"--expert-load {path}: not JSON ({e}); pass a metrics.jsonl or a JSON list") from None


def _with_expert_load(cfg, path: str):
  from framework import moe  # noqa: PLC0415
  if not cfg.model.moe:
    raise SystemExit(f"--expert-load: {cfg.name} has no experts (model.n_experts=0)")
  load = _expert_load(path)
  if len(load) and len(load[0]) != cfg.model.n_experts:
    raise SystemExit(f"--expert-load {path}: counts for {len(load[0])} experts, the config has "
                     f"{cfg.model.n_experts}")
  try:
    factor = moe.imbalance(load, cfg.mesh.expert)
  except ValueError as e:
    raise SystemExit(f"--expert-load {path}: {e}") from None
  _log(f"expert load from {path}: busiest expert-parallel rank {factor:.3f} x the mean over {cfg.mesh.expert} "
       f"ranks; pricing the capacity dispatch at that factor")
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_impl="capacity", capacity_factor=factor))


def cmd_predict(a, overrides):
  if a.trace:
    _check_writable(a.trace)
  cfg = load(a.config, _mesh_overrides(overrides, a.mesh))
  if a.expert_load:
    cfg = _with_expert_load(cfg, a.expert_load)
  from perfmodel import predict  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
  p = predict.predict(cfg, a.hardware, mode=a.mode, method=a.method, backend=a.backend, batch=a.batch,
                      prompt_len=a.prompt_len, gen_len=a.gen_len, topology=a.topology,
                      compile_budget_s=None if a.compile_budget == "full" else float(a.compile_budget),
                      framework=a.framework, trace=bool(a.trace), profile_nodes=a.profile_nodes, devices=a.devices)
  out = p.to_dict()
  if p.profiled_nodes is not None:
    print(json.dumps({"profiled_nodes": p.profiled_nodes}), file=sys.stderr)
  if a.trace:
    label = "predicted " + ("generation" if a.mode == "infer" else "step") + f" ({p.config} on {p.hardware})"
    out["trace_file"] = trace.write_file(a.trace, trace.trace_events(p.events, 0, label), {
        "config": p.config, "hardware": p.hardware, "route": p.route, "mesh": p.mesh,
        "step_time_s": p.step_time_s, "generation_s": p.generation_s})
  _print(out)


def _check_writable(path: str):
  """A --trace FILE that cannot be written fails before anything compiles."""
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
    raise ConfigError(f"--trace {path}: cannot write a file there; give a file path in an existing writable folder")


def _regime(a, trace: bool = True):
  """The measurement regime (perfmodel/calib/bench.py): one pinned core, single-threaded XLA, CPU-time clock, the
  real job's allocator; TraceMe compiled in (calibration reads it; validation keeps the same code). Set before jax
  starts: calibration and validation share it, so predictions and measurements are in the same units."""
  from perfmodel.cost import trace_nodes  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
  host_memory.apply()
  if trace:
    trace_nodes.enable()
  if not a.no_pin:
    regime.pin(a.pin_core)


def cmd_calibrate(a, overrides):
  from perfmodel import program  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
  if not (a.refit_composition or a.refit_hybrid):  # a refit times nothing
    _regime(a, trace=not a.profiled)  # the profiler's worker enables its own tracing
  program.ensure_devices(VALIDATE_DEVICES)  # the multi-device calibration programs compile on virtual devices
  from perfmodel.calib import calibrate, refit  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
  prof = calibrate.destination(commit=a.commit)
  _log(f"calibrating {prof}" + ("" if a.commit else " (the user's profile; --commit writes the committed one)"))
  if a.refit_composition:
    return _print(refit.refit(prof, a.refit_composition, log=_log))
  if a.refit_hybrid:
    return _print(refit.refit_hybrid(prof, a.refit_hybrid, log=_log))
  if a.profiled:
    return _print(refit.fit_profiled(prof, a.hlo_cache, log=_log))
  snap = calibrate.snapshot(calibrate.files(prof))
  res = calibrate.run(quick=a.quick, nodes_stage=not a.no_nodes, nodes_only=a.nodes_only,
                      step_rounds=a.step_rounds or calibrate.STEP_ROUNDS, step_statistic=a.step_statistic,
                      prof_path=prof, log=_log)
  nodes = res.get("nodes") or {}
  res["gate"] = calibrate.gate(snap, None if a.quick else nodes.get("loo_mape"),
                               calibrate.MAX_LOO_PCT if a.max_loo is None else a.max_loo)
  if res["gate"]["accepted"] and nodes and not (a.quick or a.no_profiled):
    res["profiled"] = refit.fit_profiled(prof, a.hlo_cache, log=_log)
  _print(res)
  if not res["gate"]["accepted"]:
    print(res["gate"]["message"], file=sys.stderr)
    sys.exit(2)


def cmd_validate(a, overrides):
  if a.published:
    from perfmodel.calib import published_validate  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
    out = published_validate.run(csv=a.csv, limit=a.limit, ids=[x for x in (a.rows or "").split(",") if x] or None,
                                 png=a.png or os.path.join(tempfile.gettempdir(), "perfmodel_published.png"),
                                 record=a.record, backend=a.backend, log=_log, reprice=a.reprice,
                                 save_programs=a.save_programs, strict=a.strict, compile_budget=a.compile_budget)
    return _print(out)
  from perfmodel import program  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
  _regime(a)
  program.ensure_devices(VALIDATE_DEVICES)
  from perfmodel.calib import validate  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
  png = a.png or (validate.COMMITTED_PNG if a.record else os.path.join(tempfile.gettempdir(), "perfmodel_validate.png"))
  _print(validate.run(a.suite, reps=a.reps, backend=a.backend, png=png, results=a.record,
                      limit=a.limit, measurements=a.measurements, hlo_cache=a.hlo_cache, isolate=not a.in_process,
                      rounds=a.rounds))


def cmd_floor(a, overrides):
  from perfmodel.calib.host import HostSpeed  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
  out = HostSpeed(a.statistic).floor_between(a.measurements, [e["name"] for e in suite.SUITE],
                                             [e["name"] for e in suite.INFER])
  if a.out:
    out.update({"command": " ".join(["python -m perfmodel floor", *a.measurements, "--statistic", a.statistic,
                                     "--out", a.out]),
                "machine": f"{platform.machine()} {os.cpu_count()} cores (stored measurements)",
                "date": datetime.datetime.now().isoformat(timespec="minutes")})
    with open(a.out, "w") as f:
      json.dump(out, f, indent=1)
  _print(out)


def cmd_search(a, overrides):
  cfg = load(a.config, list(overrides))  # the config's own mesh need not match --devices
  from perfmodel import program  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
  if a.run_top:
    _regime(a)
    program.ensure_devices(a.devices)
  from perfmodel import search  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
  hw = hardware.load(a.hardware)
  out = search.run(cfg, hw, a.devices, top=a.top, backend=a.backend)
  if a.run_top:
    from perfmodel.calib import layouts  # noqa: PLC0415 (loads jax: after the command's flags, see the module docstring)
    _, ranked = search.rank(cfg, hw, a.devices, a.backend)
    if ranked:
      out["run_check"] = layouts.run_check(cfg, ranked, a.devices, hw, a.refine)
  _print(out)


def _hardware_help() -> str:
  return f"target hardware profile: {' | '.join(hardware.available())} (perfmodel/profiles/), or a .json path"


_HARDWARE_HELP = _hardware_help()


def _parser():
  p = argparse.ArgumentParser(prog="python -m perfmodel")
  sub = p.add_subparsers(dest="cmd", required=True)
  sub.add_parser("emulate", help="emulate a step at the target scale (see perfmodel/emulate/README.md)")
  pr = sub.add_parser("predict", help="predict step time / tokens/s / MFU / memory (or TTFT/TPOT)")
  pr.add_argument("--config", required=True)
  pr.add_argument("--hardware", default="cpu", help=_HARDWARE_HELP)
  pr.add_argument("--mesh", default="", help="e.g. data=2,tensor=4 (axes not named are 1)")
  pr.add_argument("--devices", type=int, default=0, help="device count when the mesh has a -1 axis")
  pr.add_argument("--mode", choices=("train", "infer"), default="train")
  pr.add_argument("--method", choices=("auto", "target_compile", "compile", "rank_program", "analytic"),
                  default="auto",
                  help="auto: a TPU/GPU profile compiles the step for compile-only devices of that target "
                       "(target_compile); the cpu profile compiles the real N-device program on host devices up to "
                       "512 devices, else traces the per-rank program (rank_program), else the analytic graph")
  pr.add_argument("--topology", default=None,
                  help="target_compile: TPU slice shape (4x4x8; a multiple of it = slices) or GPU PxHxD")
  pr.add_argument("--compile-budget", default="75", metavar="SECONDS|full",
                  help="target_compile: after this many seconds, once XLA has written the optimised program, stop "
                       "the compile and price that program, memory from its buffer assignment (default 75; 'full': "
                       "always the finished executable and its memory_analysis)")
  pr.add_argument("--backend", choices=("auto", "roofline", "calibrated", "efficiency", "profiled", "learned",
                                        "hybrid"), default="auto")
  pr.add_argument("--framework", default=None,
                  help="price the step as this framework runs it (parallelism/target_flags.py: maxtext, paxml, megatron, "
                       "nemo, torchtitan, llm-foundry): its XLA flags for the target go into the compile, its "
                       "overlap options into the timeline; name the options after a colon to override its defaults: "
                       "megatron:grad_reduce,param_gather,tp_comm, torchtitan:tp_comm, nemo:none (default: "
                       "PrismLLM's step, the compiler's defaults)")
  pr.add_argument("--expert-load", default=None, metavar="FILE",
                  help="mixture of experts: price the expert work at the imbalance of measured router counts (a "
                       "run's metrics.jsonl, its last expert_load; or a JSON layers x experts list): the capacity "
                       "dispatch at factor = busiest expert-parallel rank / mean, per layer, averaged "
                       "(framework/moe.py imbalance). Default: the config's own dispatch")
  pr.add_argument("--profile-nodes", action="store_true",
                  help="time every compute instruction of this program alone on this host first (into the user's "
                       "cache; automatic when the backend resolves to profiled or hybrid)")
  pr.add_argument("--no-anchor", action="store_true", help="does nothing (predictions are at the calibration's speed)")
  pr.add_argument("--batch", type=int, default=1)
  pr.add_argument("--prompt-len", type=int, default=32)
  pr.add_argument("--gen-len", type=int, default=32)
  pr.add_argument("--trace", default=None, metavar="FILE",
                  help="write the predicted step's timeline as Chrome / Perfetto trace JSON to FILE "
                       "(https://ui.perfetto.dev), as perfmodel emulate does for its ranks")
  ca = sub.add_parser("calibrate", help="fit the cpu profile on this host (about an hour; --quick: minutes); "
                                         "writes the user's profile in ~/.cache/prismllm/profiles ($PRISMLLM_CACHE), "
                                         "which predict and validate then use")
  ca.add_argument("--quick", action="store_true")
  ca.add_argument("--commit", action="store_true",
                  help="write the committed perfmodel/profiles/cpu.json and its node data instead of the user's")
  ca.add_argument("--no-nodes", action="store_true", help="micro-benchmarks only (skip the calibration programs)")
  ca.add_argument("--nodes-only", action="store_true", help="only the calibration programs (keep the curves)")
  ca.add_argument("--max-loo", type=float, default=None, metavar="PCT",
                  help="refuse (keep the previous profile) when the calibration's leave-one-program-out error is "
                       "above this (default 15)")
  ca.add_argument("--no-profiled", action="store_true",
                  help="skip the profiled / hybrid compositions at the end (run calibrate --profiled later)")
  ca.add_argument("--step-rounds", type=int, default=None,
                  help="rounds of the calibration programs' step measurement, pooled by median (default 3)")
  ca.add_argument("--step-statistic", choices=("median", "p10"), default="p10",
                  help="which reading of the calibration programs' step times the compositions are fitted on "
                       "(default p10: the least-contended speed of a shared host); validate reads in the same one")
  ca.add_argument("--profiled", action="store_true",
                  help="after a calibration: time the calibration programs' instructions alone and fit the profiled "
                       "and hybrid compositions, with their own leave-one-out errors")
  ca.add_argument("--hlo-cache", default=None, help="with --profiled: folder of compiled programs (reused / filled)")
  ca.add_argument("--refit-composition", default="", metavar="HLO_DIR",
                  help="refit the learned backend from the stored measurements, nothing re-measured; calibration "
                       "programs read from / compiled into HLO_DIR")
  ca.add_argument("--refit-hybrid", default="", metavar="HLO_DIR",
                  help="refit the hybrid backend's choices and composition from the stored samples, profiled "
                       "database and step times, nothing re-measured")
  va = sub.add_parser("validate", help="measured vs predicted over a suite of configs on this host")
  va.add_argument("--suite", default=None, help="python file with SUITE = [...] (default: perfmodel/calib/suite.py)")
  va.add_argument("--reps", type=int, default=7)
  va.add_argument("--backend", default="auto")
  va.add_argument("--png", default=None,
                  help="default perfmodel_validate.png (--published: perfmodel_published.png) in the temporary "
                       "folder; with --record (host suite) the committed benchmarks/perfmodel_validate.png")
  va.add_argument("--published", action="store_true",
                  help="predict every included bf16 / fp8 / fp16 row of the published training runs (compiled for their "
                       "chips) instead of measuring the suite on this host")
  va.add_argument("--csv", default=None,
                  help="--published: the rows (default: benchmarks/data/published_training.csv)")
  va.add_argument("--rows", default=None, help="--published: only these row ids (comma-separated)")
  va.add_argument("--reprice", action="store_true",
                  help="--published: price the committed programs (benchmarks/data/published_programs), no compile")
  va.add_argument("--save-programs", action="store_true",
                  help="--published: commit each row's compiled program to benchmarks/data/published_programs and "
                       "price the row from it")
  va.add_argument("--strict", action="store_true",
                  help="--published: a stale committed program (other mapping, code or compiler) is an error")
  va.add_argument("--record", action="store_true",
                  help="write the committed record of this run: benchmarks/data/perfmodel_validate.json and, without "
                       "--png, benchmarks/perfmodel_validate.png; --published: benchmarks/data/published_validation.json "
                       "(with --reprice or --save-programs)")
  va.add_argument("--compile-budget", default="75", metavar="SECONDS|full",
                  help="--published: each row's predict --compile-budget (default 75, as predict: the programs a "
                       "user's predict prices; 'full': finished executables, minutes per TPU row)")
  va.add_argument("--limit", type=int, default=0, help="run only the first N configs (smoke)")
  va.add_argument("--measurements", default=None, nargs="+", metavar="FILE",
                  help="JSON of measurements by config name: reused if present, filled if not; several files: their "
                       "rounds pooled (read only)")
  va.add_argument("--rounds", type=int, default=2,
                  help="measure the whole suite this many times; each config = median over rounds")
  va.add_argument("--hlo-cache", default=None, help="folder of compiled programs by config name (reused / filled)")
  va.add_argument("--in-process", action="store_true",
                  help="measure in this process (8 host devices) instead of one child per device count")
  fl = sub.add_parser("floor", help="what a perfect model scores between stored measurement sets (no model)")
  fl.add_argument("measurements", nargs="+", metavar="FILE")
  fl.add_argument("--statistic", choices=("median", "p10"), default="p10")
  fl.add_argument("--out", default=None, metavar="FILE",
                  help="also write the result, with the command, machine and date, to FILE (the committed one: "
                       "benchmarks/data/perfmodel_floor.json)")
  se = sub.add_parser("search", help="rank layouts for a model on N devices under memory limits")
  se.add_argument("--config", required=True)
  se.add_argument("--hardware", default="cpu", help=_HARDWARE_HELP)
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
  return p


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ["emulate"]:
    # emulation owns its flags: the rest of argv goes to it untouched
    return emulate_cli.main(argv[1:])
  p = _parser()
  a, rest = p.parse_known_args(argv)
  bad = [r for r in rest if not r.startswith("--config.")]
  if bad:
    p.error(f"unrecognized arguments: {bad}")
  try:
    {"predict": cmd_predict, "calibrate": cmd_calibrate, "validate": cmd_validate, "search": cmd_search,
     "floor": cmd_floor}[a.cmd](a, rest)
  except (ConfigError, FileNotFoundError, MemoryError) as e:  # bad input: one line naming the fix, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
