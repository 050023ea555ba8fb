"""The one entry point.

  python -m experiments.run --config experiments/configs/quickstart.py --workdir DIR [--config.x=y ...]
                            [--processes N] [--host-devices N]

--processes N starts N processes on localhost (one per emulated host) that train together through
jax.distributed; on a real cluster run one copy per host with --coordinator/--num-processes/
--process-id (or none of them under SLURM / a TPU pod, where jax detects them).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys


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
  args, rest = p.parse_known_args(argv)
  bad = [a for a in rest if not a.startswith("--config.")]
  if bad:
    p.error(f"unrecognised arguments {bad} (config overrides look like --config.model.n_layers=4)")
  return args, rest


DEFAULT_HOST_DEVICES = 8  # for a mesh with a -1 (fill) axis


def host_devices(args, overrides) -> int:
  """Virtual CPU devices to ask XLA for: --host-devices, else exactly the config's mesh size.

  Why not always 8: idle virtual devices are not free. XLA:CPU's thunks then hop between 8 worker threads
  instead of 1, and a one-device step costs 1.23-1.45x more (base 23.5-24.5 ms with 1 host device against
  34.6-35.3 ms with 8, fresh processes; benchmarks/host_devices.py)."""
  if args.host_devices is not None:
    return args.host_devices
  from framework import config_file  # noqa: PLC0415 - plain Python; jax's backend is not started by it
  sizes = config_file.load(args.config, overrides).mesh.sizes()
  return DEFAULT_HOST_DEVICES if -1 in sizes.values() else math.prod(sizes.values())


def main(argv=None) -> int:
  args, overrides = parse(sys.argv[1:] if argv is None else argv)
  from framework import host_memory  # noqa: PLC0415 - before anything allocates (see the module)
  host_memory.apply()
  args.host_devices = host_devices(args, overrides)
  if args.processes > 1:
    from parallelism.distributed import launch_local  # noqa: PLC0415
    fwd = [a for a in (sys.argv[1:] if argv is None else argv)]
    fwd = _strip(fwd, "--processes")
    return launch_local(fwd, args.processes, args.host_devices)
  if "XLA_FLAGS" not in os.environ or "device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.host_devices}").strip()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
  for noisy in ("absl", "orbax", "jax._src"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  from framework import config_file  # noqa: PLC0415 - after XLA_FLAGS
  from framework.config import extras  # noqa: PLC0415
  from parallelism import distributed  # noqa: PLC0415
  cfg = config_file.load(args.config, overrides)
  if extras(cfg, "resilience"):
    import resilience  # noqa: PLC0415 - hot-swap jobs run under their own node agents
    print(json.dumps(resilience.run_hotswap(cfg, args.workdir), default=str))
    return 0
  distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  import jax  # noqa: PLC0415
  from framework.train import train_and_evaluate  # noqa: PLC0415
  logging.getLogger("prismllm").info("process %d/%d, local devices %s", jax.process_index(), jax.process_count(),
                                     jax.local_devices())
  summary = train_and_evaluate(cfg, args.workdir)
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


def cli() -> int:
  from framework.config import ConfigError  # noqa: PLC0415
  try:
    return main()
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(cli())
