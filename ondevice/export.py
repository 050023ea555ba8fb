"""python -m ondevice.export --workdir RUN --out model.gguf --quant q4_0
   python -m ondevice.export --random --config experiments/configs/ondevice_tiny.py --out model.gguf [--config.model.x=y]
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m ondevice.export", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="training workdir (config.json + orbax checkpoints)")
  src.add_argument("--random", action="store_true", help="random weights from --config (framework init)")
  ap.add_argument("--config", help="experiment config file (with --random)")
  ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  ap.add_argument("--out", required=True)
  ap.add_argument("--quant", default="f32", help="f32 | f16 | q8_0 | q4_0 | q4_k (needs llama-cpp-python)")
  ap.add_argument("--output-quant", default=None, help="type of output.weight (default: --quant)")
  ap.add_argument("--seed", type=int, default=0)
  args, overrides = ap.parse_known_args(argv)
  bad = [o for o in overrides if not o.startswith("--config.")]
  if bad:
    ap.error(f"unrecognized arguments {bad}")
  from ondevice import gguf_io, sources
  t0 = time.time()
  if args.random:
    if not args.config:
      ap.error("--random needs --config (e.g. experiments/configs/ondevice_tiny.py)")
    cfg = sources.config_from_file(args.config, overrides)
    params = sources.random_params(cfg, args.seed)
    origin = f"random seed {args.seed}"
  else:
    params, cfg, step = sources.workdir_params(args.workdir, args.step)
    origin = f"{args.workdir} step {step}"
  summary = gguf_io.export_gguf(params, cfg.model, args.out, args.quant, name=cfg.name,
                                output_quant=args.output_quant)
  summary.update(origin=origin, seconds=round(time.time() - t0, 2))
  print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
