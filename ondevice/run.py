"""python -m ondevice.run --model model.gguf [--devices devices.yaml] --prompt "..." --max-tokens N
    [--chat "message" [--system "..."]]
    [--temperature T --top-k K --top-p P --min-p M --repeat-penalty R --seed S]

Text is tokenized with the file's own tokenizer (SPM or BPE from its metadata), as llama.cpp tokenizes it;
``--chat`` formats a user message with the file's chat template. Decoding is greedy unless --temperature > 0
(ondevice/sampling.py). Streams the generated text to stdout; a JSON summary (plan, TPOT, per-device stats) goes to stderr.
Without --devices: one local device, wall-clock timing. With --devices: a ring of emulated devices
(one process each), planned by Halda unless --plan says otherwise; times are on the emulated clock.
Everything knowable before the first token (context, plan, files, draft) is checked first; bad input
ends in one `error: ...` line naming the fix and exit code 2. A ring device that dies mid-generation is
dropped and the rest re-planned (--on-peer-failure replan, the default); greedy output is unchanged.
Mixture-of-experts files run on one device (--save-expert-counts FILE keeps the run's routing counts); with
--devices they are planned only (--plan-only [--expert-counts FILE]: Halda with experts weighted by frequency).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ondevice.errors import LONG_CONTEXT_FLAG, InputError, PeerError, check_generation, cli


def load_devices_checked(path: str) -> dict:
  from ondevice.emulation import load_devices
  if not os.path.isfile(path):
    raise InputError(f"--devices {path}: no such file; pass an existing devices file (format: ondevice/README.md)")
  try:
    d = load_devices(path)
  except (ValueError, TypeError, KeyError) as e:
    raise InputError(f"--devices: {e}; fix the devices file (format: ondevice/README.md)") from None
  except Exception as e:  # yaml.YAMLError and friends: the file is not YAML
    raise InputError(f"--devices {path} is not valid YAML ({type(e).__name__}); fix the file") from None
  return d


MOE_RING = ("the ring does not run mixture-of-experts files yet (its devices keep whole layers resident, not "
            "experts): run without --devices, or add --plan-only to print Halda's expert placement")


def plan_ring(model: str, specs: list, plan_method: str, k, ctx: int, windows=None, expert_counts=None):
  """(RingPlan, kept specs) or InputError naming the fix (Halda infeasible, bad k or windows). MoE files:
  ``expert_counts`` (a --save-expert-counts file) weights the experts by activation frequency."""
  from ondevice import halda_moe, planner, profiler
  from ondevice.gguf_io import read_info
  info = read_info(model)
  counts = None
  if expert_counts is not None:
    try:
      counts = halda_moe.load_counts(expert_counts, info)
    except ValueError as e:
      raise InputError(str(e)) from None
  L = info.cfg.n_layers
  if k != "auto" and (int(k) < 1 or L % int(k)):
    raise InputError(f"--k {k} must divide the model's {L} layers; pass one of "
                     f"{[d for d in range(1, L + 1) if L % d == 0]} or auto")
  method = "manual" if (windows and plan_method == "halda") else plan_method
  if method == "manual" and (len(windows) != len(specs) or any(int(w) < 0 for w in windows)
                             or sum(int(w) for w in windows) * (1 if k == "auto" else int(k)) != L):
    raise InputError(f"windows {windows} in the devices file must give one count per device, summing to "
                     f"{L} / k; fix them or remove them to let Halda plan")
  layer_s = profiler.layer_time(model) if method == "halda" else 0.0
  head_s = profiler.head_time(model) if method == "halda" else 0.0
  try:
    p, kept = planner.plan(info, specs, method, k, layer_s, head_s, ctx, windows=windows, expert_counts=counts)
  except ValueError as e:
    kv_mb = 2 * ctx * info.cfg.n_kv_heads * info.cfg.hd * 4 / 2**20
    raise InputError(f"{e} (--ctx {ctx} costs {kv_mb:.2f} MB of KV cache per layer; lower --ctx, give the devices "
                     f"more memory, or add devices)") from None
  return p, kept, layer_s


def build_engine(model: str, devices=None, plan_method: str = "halda", k="auto", prefetch=None,
                 policy: str = "plan", ctx: int = 256, real_io: bool = False, peer_timeout_s: float = 60.0,
                 specs=None):
  """(engine, plan dict) for a model file and an optional devices file (or already-loaded ``specs``)."""
  from ondevice.device import DeviceOptions
  from ondevice.gguf_io import read_info
  from ondevice.ring import RingEngine
  info = read_info(model)
  if devices is None and specs is None:
    opts = DeviceOptions(prefetch=bool(prefetch), policy=policy, real_io=real_io, max_len=ctx)
    return RingEngine(model, [[list(range(info.cfg.n_layers))]], [None], opts), {"method": "single", "k": 1}
  if info.moe is not None:
    raise InputError(MOE_RING)
  d = load_devices_checked(devices) if specs is None else {"devices": specs, "k": k, "prefetch": prefetch,
                                                           "windows": None}
  k = d["k"] if k == "auto" else k
  pf = d["prefetch"] if prefetch is None else prefetch
  p, kept, layer_s = plan_ring(model, d["devices"], plan_method, k, ctx, d["windows"])
  opts = DeviceOptions(prefetch=pf, policy=policy, real_io=real_io, max_len=ctx)
  eng = RingEngine(model, p.windows, kept, opts, n_gpu=p.n_gpu, residency=p.residency, peer_timeout_s=peer_timeout_s)
  eng.all_specs = d["devices"]
  return eng, dict(p.as_dict(), devices=[s.name for s in kept], measured_layer_ms=1e3 * layer_s)


def check_draft(model: str, draft: str, gamma: int):
  from ondevice import gguf_check
  from ondevice.gguf_io import read_info
  if os.path.exists(draft) and os.path.samefile(draft, model):
    raise InputError("--draft is the target file itself (acceptance 1 by construction); pass a smaller draft model")
  if gamma < 1:
    raise InputError(f"--gamma {gamma}: pass --gamma >= 1")
  di, ti = read_info(draft), read_info(model)
  gguf_check.check_runnable(di)
  if di.tokens != ti.tokens:
    raise InputError(f"--draft {draft} has a different vocabulary from the target; pass a draft trained with the "
                     f"same tokenizer")


def _main(args) -> int:
  from ondevice import generate, gguf_check
  from ondevice.forward import GGUFLlama
  from ondevice.gguf_io import read_info
  from ondevice import chat as chat_lib
  from ondevice import sampling
  from ondevice import vocab as vocab_lib
  from ondevice.weights import MappedGGUF
  info = read_info(args.model)
  gguf_check.check_runnable(info)
  if args.expert_counts and not args.plan_only:
    raise InputError("--expert-counts is a planning input: add --plan-only (with --devices) to see its placement")
  if args.save_expert_counts and (info.moe is None or args.devices):
    raise InputError("--save-expert-counts needs a mixture-of-experts model run on one device (no --devices)")
  if args.plan_only:
    if not args.devices:
      raise InputError("--plan-only prints the ring's plan: pass --devices devices.yaml")
    d = load_devices_checked(args.devices)
    kk = d["k"] if args.k == "auto" else int(args.k)
    p, kept, layer_s = plan_ring(args.model, d["devices"], args.plan, kk, args.ctx, d["windows"], args.expert_counts)
    print(json.dumps(dict(p.as_dict(), devices=[s.name for s in kept], measured_layer_ms=1e3 * layer_s)))
    return 0
  try:
    voc = vocab_lib.load(args.model)
    if args.prompt_ids:
      try:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
      except ValueError:
        raise InputError(f"--prompt-ids {args.prompt_ids!r}: pass comma-separated integers") from None
    elif args.chat is not None:
      msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
          {"role": "user", "content": args.chat}]
      prompt = chat_lib.Chat(voc).tokens(msgs)
    else:
      prompt = voc.encode(args.prompt, add_special=True)
  except (vocab_lib.VocabError, chat_lib.ChatError) as e:
    raise InputError(str(e)) from None
  params = sampling.SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repeat_penalty,
                                   seed=args.seed)
  if params.check():
    raise InputError(f"--{params.check().replace('_', '-')}")
  if args.draft and not params.greedy:
    raise InputError("--draft verifies greedy tokens: drop --temperature (or --draft)")
  check_generation(prompt, args.max_tokens, args.ctx, info.cfg.vocab_size, args.gamma,
                   trained_ctx=info.cfg.max_seq_len, allow_long=args.allow_long_context)
  if len(prompt) + args.max_tokens > info.cfg.max_seq_len:
    print(f"warning: generating up to position {len(prompt) + args.max_tokens}, past the model's trained context of "
          f"{info.cfg.max_seq_len} tokens ({LONG_CONTEXT_FLAG}): untrained positions",
          file=sys.stderr)
  if args.draft:
    check_draft(args.model, args.draft, args.gamma)
  if args.peer_timeout <= 0:
    raise InputError(f"--peer-timeout {args.peer_timeout}: pass a positive number of seconds")
  if args.threads < 1:
    raise InputError(f"--threads {args.threads}: pass --threads >= 1")
  from ondevice import planes
  planes.set_threads(args.threads)
  pending = bytearray()

  def emit(tok: int):
    pending.extend(voc.piece(tok))
    try:
      s = pending.decode("utf-8")
    except UnicodeDecodeError:
      return  # wait for the rest of a multi-byte character
    sys.stdout.write(s)
    sys.stdout.flush()
    pending.clear()

  k = args.k if args.k == "auto" else int(args.k)
  pf = None if args.devices else not args.no_prefetch
  eng, plan = build_engine(args.model, args.devices, args.plan, k, pf, args.policy, args.ctx, args.real_io,
                           args.peer_timeout)
  if args.no_prefetch:
    eng.head.opts = eng.head.opts.__class__(**{**eng.head.opts.__dict__, "prefetch": False})
  stop = None if args.no_stop else voc.eog
  draft = GGUFLlama(MappedGGUF(args.draft), max_len=args.ctx) if args.draft else None
  done: list = []
  recoveries = []

  def on_token(t):
    done.append(t)
    emit(t)

  sys.stdout.write(args.prompt if not (args.prompt_ids or args.chat is not None) else "")
  try:
    while True:
      try:
        left = args.max_tokens - len(done)
        if draft is not None:
          st = generate.speculative(eng, generate.Draft(draft, eng), prompt + done, left, args.gamma, stop, on_token)
        else:
          st = generate.greedy(eng, prompt + done, left, stop, on_token,
                               None if params.greedy and params.repeat_penalty == 1 else sampling.Sampler(params))
        break
      except PeerError as e:
        if args.on_peer_failure != "replan" or e.hung or e.rank < 1 or not args.devices:
          raise
        eng, plan = _replan(args, eng, e, k, pf)
        recoveries.append({"dropped": plan["dropped"], "at_token": len(done)})
        print(f"warning: {e}; re-planned without {plan['dropped']} and continuing from token {len(done)}",
              file=sys.stderr)
    sys.stdout.write(pending.decode("utf-8", errors="replace") + "\n")
    summary = {"plan": plan, **st.as_dict(), "tokens": len(done), "token_ids": done,
               "clock": "emulated" if eng.head.emulated else "wall",
               "recoveries": recoveries, "devices": eng.stats()}
    print(json.dumps(summary), file=sys.stderr)
    if args.save_expert_counts:
      from ondevice import halda_moe
      halda_moe.save_counts(args.save_expert_counts, info, eng.head.model.experts.counts)
  finally:
    eng.close()
  return 0


def _replan(args, eng, err: PeerError, k, pf):
  """The ring without the device that died: Halda on the rest, a fresh ring; the caller re-prefills."""
  dead = eng.specs[err.rank]
  specs = [s for s in eng.all_specs if s is not dead]
  eng.close()
  new, plan = build_engine(args.model, None, args.plan, k, pf, args.policy, args.ctx, args.real_io, args.peer_timeout,
                           specs=specs)
  return new, dict(plan, dropped=dead.name)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m ondevice.run", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", required=True)
  ap.add_argument("--devices", default=None, help="devices.yaml (real or emulated devices); default: one local")
  ap.add_argument("--prompt", default="")
  ap.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of --prompt")
  ap.add_argument("--max-tokens", type=int, default=32)
  ap.add_argument("--chat", default=None, help="a user message, formatted with the file's chat template")
  ap.add_argument("--system", default=None, help="with --chat: a system message before it")
  ap.add_argument("--greedy", action="store_true", help="greedy decoding (the default; same as --temperature 0)")
  ap.add_argument("--temperature", type=float, default=0.0, help="> 0 samples (ondevice/sampling.py)")
  ap.add_argument("--top-k", type=int, default=40)
  ap.add_argument("--top-p", type=float, default=0.95)
  ap.add_argument("--min-p", type=float, default=0.05)
  ap.add_argument("--repeat-penalty", type=float, default=1.0)
  ap.add_argument("--seed", type=int, default=None, help="sampling seed (the same seed gives the same text)")
  ap.add_argument("--draft", default=None, help="draft GGUF for speculative decoding (same vocab)")
  ap.add_argument("--gamma", type=int, default=4)
  ap.add_argument("--plan", default="halda", choices=["halda", "memory", "equal", "single"])
  ap.add_argument("--k", default="auto")
  ap.add_argument("--ctx", type=int, default=256, help="context (KV cache) length in tokens")
  ap.add_argument(LONG_CONTEXT_FLAG, action="store_true",
                  help="allow a prompt plus --max-tokens longer than the model's trained context (the GGUF's "
                       "context_length): positions past it are untrained, and RoPE scaling is not implemented")
  ap.add_argument("--no-prefetch", action="store_true")
  ap.add_argument("--policy", default="plan", choices=["plan", "os"])
  ap.add_argument("--real-io", action="store_true", help="issue real madvise/fadvise prefetch/release")
  ap.add_argument("--no-stop", action="store_true", help="do not stop at the file's end-of-generation tokens")
  ap.add_argument("--threads", type=int, default=1, help="kernel threads per device process (planes.set_threads)")
  ap.add_argument("--peer-timeout", type=float, default=60.0, help="seconds a ring pass may take (hang detection)")
  ap.add_argument("--on-peer-failure", default="replan", choices=["replan", "fail"],
                  help="a ring device that dies: re-plan without it and continue, or stop with an error")
  ap.add_argument("--plan-only", action="store_true", help="with --devices: print the ring's plan (JSON) and exit")
  ap.add_argument("--expert-counts", default=None,
                  help="MoE, with --plan-only: routing counts (a --save-expert-counts file) that weight Halda's expert "
                       "placement by activation frequency (default: the uniform prior top_k / n_expert)")
  ap.add_argument("--save-expert-counts", default=None,
                  help="MoE, one device: write the run's per-layer per-expert routing counts (JSON) to this file")
  args = ap.parse_args(argv)
  if args.k != "auto" and not args.k.isdigit():
    ap.error(f"--k {args.k}: pass a positive integer or auto")
  if args.greedy:
    args.temperature = 0.0
  return cli(_main, args)


if __name__ == "__main__":
  sys.exit(main())
