"""python -m ondevice.export --workdir RUN --out model.gguf --quant q4_0
   python -m ondevice.export --random --config experiments/configs/ondevice_tiny.py --out model.gguf [--config.model.x=y]
   python -m ondevice.export --from-gguf target.gguf --keep-layers 2 --out draft.gguf --quant q4_0
     (a self-speculative draft: the target's first N blocks + its embedding and output head, as in
      LayerSkip / draft-and-verify; re-quantised from the file's dequantised weights)
   python -m ondevice.export --hf-dir CHECKPOINT --out model.gguf --quant q4_k_m [--byte-vocab]
     (a Hugging Face Llama 3.x / Mistral / Qwen2 / Qwen3 directory with its tokenizer: ondevice/hf_gguf.py)
   python -m ondevice.export --random-moe qwen3moe --moe n_layers=4,d_model=512,n_expert=16,n_used=2,ff=512 \
       --out moe.gguf --quant q8_0
     (a random mixture-of-experts file in llama.cpp's layout: qwen3moe or mixtral shape; testmodels.moe_gguf)
--quant: f32 | f16 | bf16 | q8_0 | q4_0, or q4_k_m | q5_k_m | q6_k (an F16 file through llama.cpp's quantiser).
A mixture-of-experts model (--workdir / --random with model.n_experts > 0) is written in llama.cpp's Mixtral layout
(arch llama, llama.expert_count / expert_used_count, ffn_gate_inp + stacked ffn_{gate,up,down}_exps; names from
framework/names.py); what Mixtral cannot express (shared experts, sigmoid router, router_scale != 1, router bias)
is refused in one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


def jax_tree_slice(tree, n: int):
  """The first n entries along the stacked layer axis of every array in a (nested dict) params tree."""
  if isinstance(tree, dict):
    return {k: jax_tree_slice(v, n) for k, v in tree.items()}
  return tree[:n]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m ondevice.export", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="training workdir (config.json + orbax checkpoints)")
  src.add_argument("--random", action="store_true", help="random weights from --config (framework init)")
  src.add_argument("--from-gguf", help="an existing GGUF (with --keep-layers: a layer-truncated draft)")
  src.add_argument("--random-moe", choices=["qwen3moe", "mixtral"], help="a random MoE file of this shape")
  src.add_argument("--hf-dir", help="a Hugging Face checkpoint directory (config.json, safetensors, tokenizer)")
  ap.add_argument("--byte-vocab", action="store_true", help="with --hf-dir: PrismLLM's byte vocabulary instead")
  ap.add_argument("--keep-layers", type=int, default=None, help="with --from-gguf: keep the first N blocks")
  ap.add_argument("--config", help="experiment config file (with --random)")
  ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  ap.add_argument("--out", required=True)
  ap.add_argument("--quant", default="f32", help="f32 | f16 | bf16 | q8_0 | q4_0 | q4_k_m | q5_k_m | q6_k (the "
                                                 "last three need llama-cpp-python)")
  ap.add_argument("--output-quant", default=None, help="type of output.weight (default: --quant)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--moe", default="", help="with --random-moe: k=v,... of testmodels.moe_gguf (n_layers, d_model, "
                                           "n_heads, n_kv_heads, n_expert, n_used, ff, vocab_size, max_len)")
  args, overrides = ap.parse_known_args(argv)
  bad = [o for o in overrides if not o.startswith("--config.")]
  if bad:
    ap.error(f"unrecognized arguments {bad}")
  if args.random_moe:
    from ondevice.errors import cli
    return cli(_export_moe, args)
  if not args.from_gguf:  # these read weights through jax: start it without the compile-only plugins' noise
    from framework import platforms
    platforms.import_jax()
  from ondevice.errors import cli
  return cli(_export, ap, args, overrides)


def _export_moe(args) -> int:
  from ondevice import testmodels
  from ondevice.errors import InputError
  keys = ("n_layers", "d_model", "n_heads", "n_kv_heads", "n_expert", "n_used", "ff", "vocab_size", "max_len")
  kw = {}
  for item in [x for x in args.moe.split(",") if x.strip()]:
    k, _, v = item.partition("=")
    if k.strip() not in keys or not v.strip().isdigit():
      raise InputError(f"--moe {item!r}: pass k=INT with k one of {', '.join(keys)}")
    kw[k.strip()] = int(v)
  if not 1 <= kw.get("n_used", 2) <= kw.get("n_expert", 8):
    raise InputError("--moe: n_used must be between 1 and n_expert")
  t0 = time.time()
  summary = testmodels.moe_gguf(args.out, args.random_moe, args.quant, seed=args.seed, **kw)
  summary.update(origin=f"random {args.random_moe} seed {args.seed}", seconds=round(time.time() - t0, 2))
  print(json.dumps(summary))
  return 0


def _export(ap, args, overrides) -> int:
  from ondevice import gguf_io
  from ondevice.errors import InputError
  try:
    return _export_body(ap, args, overrides)
  except (FileNotFoundError, ImportError) as e:
    raise InputError(f"{e}; fix the path") from None
  except gguf_io.GGUFError:
    raise
  except ValueError as e:  # vocab.VocabError, framework.hf.HFError: what the checkpoint has that we cannot write
    from ondevice.vocab import VocabError
    from framework.hf import HFError
    if isinstance(e, (VocabError, HFError)):
      raise InputError(str(e)) from None
    raise
  except OSError as e:
    raise InputError(f"writing {args.out} failed ({e.strerror or e}); any file that was there is unchanged: free "
                     f"space or pick another --out") from None


def _export_body(ap, args, overrides) -> int:
  from ondevice import gguf_io, sources
  t0 = time.time()
  if args.hf_dir:
    from ondevice import hf_gguf
    summary = hf_gguf.convert(args.hf_dir, args.out, args.quant, tokenizer=not args.byte_vocab)
    summary.update(origin=args.hf_dir, seconds=round(time.time() - t0, 2))
    print(json.dumps(summary))
    return 0
  if args.random:
    if not args.config:
      ap.error("--random needs --config (e.g. experiments/configs/ondevice_tiny.py)")
    cfg = sources.config_from_file(args.config, overrides)
    params = sources.random_params(cfg, args.seed)
    origin = f"random seed {args.seed}"
  elif args.from_gguf:
    params, model_cfg = gguf_io.load_params(args.from_gguf)
    n = args.keep_layers or model_cfg.n_layers
    if not 1 <= n <= model_cfg.n_layers:
      from ondevice.errors import InputError
      raise InputError(f"--keep-layers {n}: the file has {model_cfg.n_layers} blocks; pass 1..{model_cfg.n_layers}")
    params = dict(params, layers=jax_tree_slice(params["layers"], n))
    model_cfg = dataclasses.replace(model_cfg, n_layers=n)
    name = f"{os.path.basename(args.from_gguf)}:layers={n}"
    origin = f"{args.from_gguf}, first {n} blocks"
  else:
    params, cfg, step = sources.workdir_params(args.workdir, args.step)
    origin = f"{args.workdir} step {step}"
  if not args.from_gguf:
    model_cfg, name = cfg.model, cfg.name
  export = gguf_io.export_moe_gguf if model_cfg.moe else gguf_io.export_gguf
  summary = export(params, model_cfg, args.out, args.quant, name=name, output_quant=args.output_quant)
  summary.update(origin=origin, seconds=round(time.time() - t0, 2))
  print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
