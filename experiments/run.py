"""The one entry point.

  python -m experiments.run --config experiments/configs/quickstart.py --workdir DIR [--config.x=y ...]
                            [--processes N] [--host-devices N] [--verbose] [--debug]

--processes N starts N processes on localhost (one per emulated host) that train together through
jax.distributed; on a real cluster run one copy per host with --coordinator/--num-processes/
--process-id (or none of them under SLURM / a TPU pod, where jax detects them).

Ctrl-C (SIGINT) or SIGTERM stops training after the current step with a checkpoint there and one line saying
how to resume (exit 130 / 0); a second signal exits at once. A mistake or a machine state a user can fix
(config, corpus, workdir in use or a file, checkpoint, full disk) ends in one line naming the fix and exit
code 2 (config), 3 (checkpoint), 4 (hot swap) or 5 (workdir); --debug shows the traceback instead.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import sys
from typing import Optional

import resilience
from framework import config_file, host_memory, platforms, xla_flags
from framework import workdir as workdir_lib
from framework.checkpoint import CheckpointError, checkpoint_dir, disk_full, remove_partial_saves
from framework.config import ConfigError, extras
from framework.stop import Stopped
from framework.workdir import WorkdirError
from parallelism import distributed
from resilience.recovery import RunFailed


def parse(argv):
  p = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="experiments/configs/x.py[:arg]")
  p.add_argument("--workdir", required=True)
  p.add_argument("--processes", type=int, default=1, help="local multi-process launch (CPU, gloo)")
  p.add_argument("--host-devices", type=int, default=None,
                 help="emulated CPU devices in total (CPU only); default: the config's mesh size (8 if an axis is -1)")
  p.add_argument("--coordinator", default=None, help="host:port of process 0 (multi-host)")
  p.add_argument("--num-processes", type=int, default=None)
  p.add_argument("--process-id", type=int, default=None)
  p.add_argument("--verbose", action="store_true", help="show start-up logs too (the CUDA compile-only plugin's)")
  p.add_argument("--debug", action="store_true", help="a traceback instead of a one-line error")
  args, rest = p.parse_known_args(argv)
  bad = [a for a in rest if not a.startswith("--config.")]
  if bad:
    p.error(f"unrecognised arguments {bad} (config overrides look like --config.model.n_layers=4)")
  return args, rest


DEFAULT_HOST_DEVICES = 8  # for a mesh with a -1 (fill) axis


def host_devices(args, overrides) -> int:
  """Virtual CPU devices to ask XLA for: --host-devices, else exactly the config's mesh size.

  Why not always 8: idle virtual devices are not free. XLA:CPU's thunks then hop between 8 worker threads
  instead of 1, and a one-device step costs 1.2-1.5x more with 8 host devices than with 1."""
  if args.host_devices is not None:
    return args.host_devices
  sizes = config_file.load(args.config, overrides).mesh.sizes()
  return DEFAULT_HOST_DEVICES if -1 in sizes.values() else math.prod(sizes.values())


def train(cfg, workdir: str, max_steps: Optional[int] = None) -> dict:
  """Trains ``cfg`` in ``workdir`` in this process, on all the devices jax sees (resuming from a checkpoint
  there); returns the loop's summary (with the final ``state``). What ``main`` runs; notebooks call it."""
  # jax starts here, not at import: this module sets XLA_FLAGS first (main) and must stay importable without it.
  from framework.train import train_and_evaluate  # noqa: PLC0415 (loads jax: after main's allocator and XLA flags, and platforms.import_jax)
  from parallelism.step import build_on_devices  # noqa: PLC0415 (loads jax: after main's allocator and XLA flags, and platforms.import_jax)
  return train_and_evaluate(cfg, workdir, build=build_on_devices, max_steps=max_steps)


def main(argv=None) -> int:
  args, overrides = parse(sys.argv[1:] if argv is None else argv)
  host_memory.apply()  # before anything allocates (see the module)
  args.host_devices = host_devices(args, overrides)
  if args.processes > 1:
    fwd = [a for a in (sys.argv[1:] if argv is None else argv)]
    fwd = _strip(fwd, "--processes")
    return distributed.launch_local(fwd, args.processes, args.host_devices)
  xla_flags.set_host_device_count(args.host_devices, keep_existing=True)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
  for noisy in ("absl", "orbax", "jax._src"):
    logging.getLogger(noisy).setLevel(logging.INFO if args.verbose else logging.WARNING)
  cfg = config_file.load(args.config, overrides)
  if extras(cfg, "resilience"):
    print(json.dumps(resilience.run_hotswap(cfg, args.workdir), default=str))
    return 0
  # The workdir is locked before jax starts (seconds): a second run on it is refused at once. The training
  # loop takes the same lock (process 0 only where several processes train together).
  first = (args.process_id or 0) == 0 and not _auto_cluster()
  early = workdir_lib.lock(args.workdir, "training run") if first else None
  try:
    return _train_main(args, cfg)
  finally:
    if early is not None:
      early.release()


def _auto_cluster() -> bool:
  """A cluster launch whose process ids jax detects itself (SLURM, a TPU pod): process 0 is known later."""
  return int(os.environ.get("SLURM_NTASKS", "1")) > 1 or os.environ.get("PRISMLLM_DISTRIBUTED") == "1"


def _train_main(args, cfg) -> int:
  # jax is imported only now, after XLA_FLAGS.
  jax = platforms.import_jax(verbose=args.verbose)
  distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  logging.getLogger("prismllm").info("process %d/%d, local devices %s", jax.process_index(), jax.process_count(),
                                     jax.local_devices())
  summary = train(cfg, args.workdir)
  summary.pop("state", None)
  if jax.process_index() == 0:
    print("\n--- sample ---\n" + summary.get("sample", "") + "\n--------------")
    print(json.dumps({k: v for k, v in summary.items() if k != "sample"}))
  return 0


def _strip(argv, flag):
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    if a == flag:
      skip = True
      continue
    if a.startswith(flag + "="):
      continue
    out.append(a)
  return out


def cli(argv=None) -> int:
  """``main`` with a stop on a signal and the errors a user can fix printed as one line (no traceback): exit
  codes 130 / 0 (stopped by SIGINT / SIGTERM), 2 (config), 3 (checkpoint), 4 (hot swap), 5 (workdir)."""
  args = sys.argv[1:] if argv is None else argv
  if "--debug" in args:
    return _stopped_or(main, args, Stopped)
  try:
    return _stopped_or(main, args, Stopped)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  except CheckpointError as e:
    print(f"checkpoint error: {e}", file=sys.stderr)
    return 3
  except RunFailed as e:
    print(f"hot-swap run failed: {e}", file=sys.stderr)
    return 4
  except WorkdirError as e:
    print(f"workdir error: {e}", file=sys.stderr)
    return 5
  except OSError as e:
    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS):
      raise
    print(f"workdir error: {e.strerror} writing {e.filename or 'a file'}: free space or fix the permissions there, "
          f"or use another --workdir; then rerun to resume from the last checkpoint", file=sys.stderr)
    return 5
  except Exception as e:  # noqa: BLE001 - a full disk surfaces from orbax's threads as ValueError and others too
    if not disk_full(e):
      raise
    wd = _value_of(args, "--workdir")
    removed = remove_partial_saves(checkpoint_dir(wd)) if wd else []
    print(f"workdir error: no space left on device writing to {wd or 'the workdir'} ({type(e).__name__}): free "
          f"space there (or use a --workdir on a larger disk) and rerun to resume from the last complete "
          f"checkpoint{'; partial saves removed: ' + ', '.join(removed) if removed else ''}", file=sys.stderr)
    return 5
  except KeyboardInterrupt:
    print("stopped by SIGINT outside the training steps (start-up or the final sample); the workdir's complete "
          "checkpoints are kept: run the same command again to resume", file=sys.stderr)
    return 130


def _value_of(argv, flag: str) -> Optional[str]:
  for i, a in enumerate(argv):
    if a == flag and i + 1 < len(argv):
      return argv[i + 1]
    if a.startswith(flag + "="):
      return a.split("=", 1)[1]
  return None


def _stopped_or(fn, args, stopped):
  try:
    return fn(args)
  except stopped as e:
    print(str(e), file=sys.stderr)
    return e.exit_code


if __name__ == "__main__":
  sys.exit(cli())
