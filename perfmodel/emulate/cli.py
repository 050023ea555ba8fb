"""python -m perfmodel emulate --config <experiment config> [--config.x=y ...] --mesh data=64,tensor=8,pipeline=16
                              [--ranks auto|0,17,...] --hardware <profile> --out DIR

Prints one JSON object (emulated_devices, real_devices, iteration_time_s per rank and overall,
peak_memory_bytes per rank, wall_time_s, ...) and writes Perfetto traces to DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from framework import config as config_lib
from framework import config_file, host_memory
from perfmodel import hardware as hw_lib
from perfmodel.emulate import topology


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m perfmodel emulate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="experiments/configs/x.py[:arg]")
  p.add_argument("--mesh", default="", help="target mesh, e.g. data=64,tensor=8,pipeline=16 (default: the config's)")
  p.add_argument("--ranks", default="auto", help="'auto' (one per distinct program) or comma-separated rank ids")
  p.add_argument("--hardware", default="cpu", help=f"target hardware profile: {' | '.join(hw_lib.available())} "
                                                    f"(perfmodel/profiles/), or a .json path")
  p.add_argument("--local-hardware", default="cpu", help="profile of the device the real rank runs on")
  p.add_argument("--out", default=None, help="directory for trace files and emulation.json")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--colocated", default="1",
                 help="target ranks sharing one host's memory system (CPU hosts): the real rank is timed while "
                      "N-1 shadow processes replay their load on the other cores; 'auto' = min(cores, ranks) for "
                      "a cpu target on a cpu device, else 1")
  p.add_argument("--compile-only", action="store_true",
                 help="do not execute: on a TPU / GPU target every rank class is priced from the target-compiled "
                      "program as predict prices it; on the cpu target the per-rank program by roofline")
  p.add_argument("--framework", default=None,
                 help="with --compile-only on a target: price as this framework runs (perfmodel predict --framework)")
  p.add_argument("--topology", default=None, help="with --compile-only on a target: its slice / node shape")
  p.add_argument("--no-stragglers", action="store_true",
                 help="do not add the wait for the slowest rank (peers varying like the measured rank's steps)")
  p.add_argument("--replay-collectives", action="store_true",
                 help="cpu target: time the program's own 2-rank collective calls between 2 real gloo processes on "
                      "this host (needs 2 free cores) instead of pricing them from the calibrated curves")
  p.add_argument("--trace-nodes", action="store_true",
                 help="split the rank's measured step over its instructions by their traced in-program times "
                      "(XLA TraceMe) instead of roofline shares: measured per-tick/per-segment timing")
  p.add_argument("--lockstep-shadows", action="store_true",
                 help="with --colocated N>1: each shadow starts a step when the measured rank does, instead of "
                      "running steps back to back (co-located ranks leave each synchronising collective together)")
  p.add_argument("--exact-memory", action="store_true",
                 help="also compile the real N-device program on N virtual CPU devices (N <= 1024) for exact memory")
  args, rest = p.parse_known_args(argv)
  bad = [a for a in rest if not a.startswith("--config.")]
  if bad:
    p.error(f"unrecognised arguments {bad} (config overrides look like --config.model.n_layers=4)")
  return args, rest


def mesh_overrides(mesh: dict) -> list:
  return [f"--config.mesh.{a}={mesh.get(a, 1)}" for a in config_lib.MESH_AXES] if mesh else []


def _colocated(spec: str, n: int, hardware: str, local_hardware: str) -> int:
  if spec != "auto":
    try:
      v = int(spec)
    except ValueError:
      raise SystemExit(f"--colocated {spec!r}: give a positive integer or 'auto'") from None
    if v < 1:
      raise SystemExit(f"--colocated {v}: give a positive integer or 'auto'")
    return v
  if hw_lib.load(hardware).device_kind == "cpu" and hw_lib.load(local_hardware).device_kind == "cpu":
    return max(1, min(n, os.cpu_count() or 1))
  return 1


def _ranks(spec: str, n: int):
  """--ranks: None for 'auto', else distinct rank ids in [0, n); anything else exits with one line."""
  if spec.strip() in ("auto", ""):
    return None
  try:
    ranks = [int(x) for x in spec.split(",") if x.strip()]
  except ValueError:
    raise SystemExit(f"--ranks {spec!r}: give comma-separated rank ids in 0..{n - 1} or 'auto'") from None
  bad = [r for r in ranks if not 0 <= r < n]
  if bad or not ranks:
    raise SystemExit(f"--ranks {spec!r}: this mesh has {n} ranks, so ids run 0..{n - 1}; pass ids in that range "
                     f"or 'auto'")
  return list(dict.fromkeys(ranks))


def main(argv=None) -> int:
  args, overrides = parse(sys.argv[1:] if argv is None else argv)
  host_memory.apply()  # the real job's allocator regime (experiments.run applies it too), before jax starts
  if args.trace_nodes:
    from perfmodel.cost import trace_nodes  # noqa: PLC0415 (loads jax: after host_memory.apply() and the XLA flags)
    trace_nodes.enable()  # XLA reads its flags when the backend starts: before anything touches a device
  # what runs on jax loads after the allocator settings and XLA flags
  from perfmodel.emulate import emulator  # noqa: PLC0415 (loads jax: after host_memory.apply() and the XLA flags)
  mesh = topology.parse_mesh(args.mesh)
  overrides = list(overrides) + mesh_overrides(mesh) + ["--config.mesh.form=shard_map"]
  cfg = config_file.load(args.config, overrides)
  n = 1
  for a in config_lib.MESH_AXES:
    n *= max(1, getattr(cfg.mesh, a))
  cfg = config_lib.validate(cfg, n)
  ranks = _ranks(args.ranks, n)
  notes = list(config_lib.extras(cfg, "emulate").get("notes", ()))
  colocated = _colocated(args.colocated, n, args.hardware, args.local_hardware)
  res = emulator.emulate(cfg, ranks=ranks, colocated=colocated, hardware=args.hardware, local_hardware=args.local_hardware,
                         out_dir=args.out, repeats=args.repeats, warmup=args.warmup, execute=not args.compile_only,
                         exact_memory=(args.config, overrides) if args.exact_memory else None, notes=notes,
                         stragglers=not args.no_stragglers, replay_collectives=args.replay_collectives,
                         trace_nodes=args.trace_nodes, lockstep_shadows=args.lockstep_shadows,
                         framework=args.framework, topology=args.topology)
  print(json.dumps(res, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
