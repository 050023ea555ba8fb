"""python -m ondevice.run --model model.gguf [--devices devices.yaml] --prompt "..." --max-tokens N [--greedy]

Streams the generated text to stdout; a JSON summary (plan, TPOT, per-device stats) goes to stderr.
Without --devices: one local device, wall-clock timing. With --devices: a ring of emulated devices
(one process each), planned by Halda unless --plan says otherwise; times are on the emulated clock.
"""
from __future__ import annotations

import argparse
import json
import sys


def build_engine(model: str, devices: str = None, plan_method: str = "halda", k="auto", prefetch=None,
                 policy: str = "plan", ctx: int = 256, real_io: bool = False):
  """(engine, plan dict) for a model file and an optional devices file."""
  from ondevice import planner, profiler
  from ondevice.device import DeviceOptions
  from ondevice.emulation import load_devices
  from ondevice.gguf_io import read_info
  from ondevice.ring import RingEngine
  info = read_info(model)
  if devices is None:
    opts = DeviceOptions(prefetch=bool(prefetch), policy=policy, real_io=real_io, max_len=ctx)
    return RingEngine(model, [[list(range(info.cfg.n_layers))]], [None], opts), {"method": "single", "k": 1}
  d = load_devices(devices)
  specs = d["devices"]
  k = d["k"] if k == "auto" else k
  pf = d["prefetch"] if prefetch is None else prefetch
  method = "manual" if (d["windows"] and plan_method == "halda") else plan_method
  layer_s = profiler.layer_time(model) if method == "halda" else 0.0
  head_s = profiler.head_time(model) if method == "halda" else 0.0
  p, specs = planner.plan(info, specs, method, k, layer_s, head_s, ctx, windows=d["windows"])
  opts = DeviceOptions(prefetch=pf, policy=policy, real_io=real_io, max_len=ctx)
  eng = RingEngine(model, p.windows, specs, opts, n_gpu=p.n_gpu, residency=p.residency)
  return eng, dict(p.as_dict(), devices=[s.name for s in specs], measured_layer_ms=1e3 * layer_s)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m ondevice.run", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", required=True)
  ap.add_argument("--devices", default=None, help="devices.yaml (real or emulated devices); default: one local")
  ap.add_argument("--prompt", default="")
  ap.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of --prompt")
  ap.add_argument("--max-tokens", type=int, default=32)
  ap.add_argument("--greedy", action="store_true", help="greedy decoding (the only mode implemented)")
  ap.add_argument("--draft", default=None, help="draft GGUF for speculative decoding (same vocab)")
  ap.add_argument("--gamma", type=int, default=4)
  ap.add_argument("--plan", default="halda", choices=["halda", "memory", "equal", "single"])
  ap.add_argument("--k", default="auto")
  ap.add_argument("--ctx", type=int, default=256)
  ap.add_argument("--no-prefetch", action="store_true")
  ap.add_argument("--policy", default="plan", choices=["plan", "os"])
  ap.add_argument("--real-io", action="store_true", help="issue real madvise/fadvise prefetch/release")
  ap.add_argument("--no-stop", action="store_true", help="do not stop at the file's EOS token")
  args = ap.parse_args(argv)
  from ondevice import generate
  from ondevice.forward import GGUFLlama
  from ondevice.gguf_io import GGUFError, read_info
  from ondevice.tokenizer import ByteTokenizer, piece_bytes
  from ondevice.weights import MappedGGUF
  try:
    info = read_info(args.model)
  except GGUFError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.prompt_ids:
    prompt = [int(t) for t in args.prompt_ids.split(",")]
  elif info.byte_tokenizer:
    prompt = ByteTokenizer(info.cfg.vocab_size).encode(args.prompt)
  else:
    print("error: this file's vocabulary is not PrismLLM's byte tokenizer; pass --prompt-ids", file=sys.stderr)
    return 2
  if not prompt:
    print("error: empty prompt; pass --prompt TEXT or --prompt-ids", file=sys.stderr)
    return 2
  pending = bytearray()

  def emit(tok: int):
    pending.extend(piece_bytes(info.tokens[tok], info.token_types[tok]))
    try:
      s = pending.decode("utf-8")
    except UnicodeDecodeError:
      return  # wait for the rest of a multi-byte character
    sys.stdout.write(s)
    sys.stdout.flush()
    pending.clear()

  k = args.k if args.k == "auto" else int(args.k)
  eng, plan = build_engine(args.model, args.devices, args.plan, k, None if args.devices else not args.no_prefetch,
                           args.policy, args.ctx, args.real_io)
  if args.no_prefetch:
    eng.head.opts = eng.head.opts.__class__(**{**eng.head.opts.__dict__, "prefetch": False})
  stop = None if args.no_stop else info.eos_id
  try:
    sys.stdout.write(args.prompt if not args.prompt_ids else "")
    if args.draft:
      draft = generate.Draft(GGUFLlama(MappedGGUF(args.draft), max_len=args.ctx), eng)
      st = generate.speculative(eng, draft, prompt, args.max_tokens, args.gamma, stop, emit)
    else:
      st = generate.greedy(eng, prompt, args.max_tokens, stop, emit)
    sys.stdout.write(pending.decode("utf-8", errors="replace") + "\n")
    summary = {"plan": plan, **st.as_dict(), "clock": "emulated" if eng.head.emulated else "wall",
               "devices": eng.stats()}
    print(json.dumps(summary), file=sys.stderr)
  finally:
    eng.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
