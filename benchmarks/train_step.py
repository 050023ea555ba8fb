"""Train-step benchmark: framework vs a hand-written jax.jit step, FLOP efficiency, and every layout.

  python -m benchmarks.train_step                 # 26M-param Llama (d512, 8 layers, seq 256), all layouts
  python -m benchmarks.train_step --quick         # tiny model, few reps: a smoke run of every path (~minutes)
  python -m benchmarks.train_step --layouts jit:data,shard_map:tensor   # or 'none' / 'all'
  python -m benchmarks.train_step --config.data.global_batch=16 --config.model.n_kv_heads=4
  python -m benchmarks.train_step --gpu           # ~1B Llama-3.2-1B-shaped model, bf16, MFU (not run: needs a GPU)
  python -m benchmarks.train_step --pin           # one core, single-threaded kernels: CPU time = work done
  XLA_FLAGS=--xla_cpu_multi_thread_eigen=false python -m benchmarks.train_step ...   # XLA flags pass through

What it measures (one JSON object on stdout; with the default model and ``--layouts none`` also written, with the
command, machine and date, to benchmarks/data/train_step.json, or wherever ``--json`` says):
* ``single``: one device. The framework step (parallelism.step.build_step on a 1-device mesh: the
  code path training uses) and benchmarks/plain_llama.py (pure jax.numpy, same math, same AdamW,
  also jit + donation) are run from the SAME parameters; their losses must agree (checked, reported).
  They are then timed side by side, alternating which goes first, ``--reps`` times ``--steps`` steps;
  between them the host's dense f32 matmul rate is measured (n=1024 and 2048, the better of the two).
  Reported: medians, the median of the per-repetition paired ratios (robust to load drifting
  between repetitions) and its min/max as the noise band; achieved FLOP/s uses framework/flops.py's
  convention. XLA's own FLOP count and op counts of both compiled steps are reported too: they
  do not depend on machine load, so they explain a gap without timing noise.
* Every time is taken twice: wall clock (the goal's unit; meaningful on a quiet machine only) and the
  process's CPU time (``*_cpu`` keys: all threads, user + system). On a shared, oversubscribed host the
  wall clock measures the queue; CPU-time ratios stay within a few percent between runs.
* ``layouts``: the framework step on 8 emulated CPU devices per layout, each timed paired with the
  single-device framework step. Emulated devices share the host's cores, so a layout cannot be
  faster than one device; the ratio measures partitioning + collective overhead. Layouts that
  raise are recorded with the error, not hidden.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import ml_collections

from benchmarks import provenance
from framework import config as config_lib
from framework import config_file, xla_flags
from framework.config import from_dict

REPO = pathlib.Path(__file__).resolve().parents[1]

# name -> (mesh sizes, form, extra mesh fields). Every product is 8.
LAYOUTS = {
    "jit:data": (dict(data=8), "jit", {}),
    "jit:fsdp": (dict(fsdp=8), "jit", {}),
    "jit:tensor": (dict(tensor=8), "jit", {}),
    "jit:data_x_tensor": (dict(data=2, tensor=4), "jit", {}),
    "jit:fsdp_x_tensor": (dict(fsdp=2, tensor=4), "jit", {}),
    "jit:sequence": (dict(sequence=8), "jit", {}),
    "shard_map:data": (dict(data=8), "shard_map", {}),
    "shard_map:fsdp": (dict(fsdp=8), "shard_map", {}),
    "shard_map:tensor": (dict(tensor=8), "shard_map", {}),
    "shard_map:data_x_tensor": (dict(data=2, tensor=4), "shard_map", {}),
    "shard_map:fsdp_x_tensor": (dict(fsdp=2, tensor=4), "shard_map", {}),
    "shard_map:sequence": (dict(sequence=8), "shard_map", {}),
    "pipeline:gpipe": (dict(pipeline=4, data=2), "shard_map", dict(microbatches=4, schedule="gpipe")),
    "pipeline:1f1b": (dict(pipeline=4, data=2), "shard_map", dict(microbatches=4, schedule="1f1b")),
}

MODELS = {
    # MHA (n_kv_heads = n_heads) so that tensor=8 divides the kv heads; GQA: --config.model.n_kv_heads=4
    # (then the layouts with tensor=8 report the divisibility error).
    "cpu": dict(model=dict(vocab_size=256, d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, max_seq_len=256),
                data=dict(seq_len=256, global_batch=8)),
    "quick": dict(model=dict(vocab_size=256, d_model=128, n_layers=4, n_heads=8, n_kv_heads=8, max_seq_len=64),
                  data=dict(seq_len=64, global_batch=8)),
    # Llama-3.2-1B shape (1.24B params, tied embeddings, 128k vocab), bf16 compute, f32 params + AdamW.
    "gpu": dict(model=dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                           tie_embeddings=True, rope_theta=500000.0, max_seq_len=2048, dtype="bfloat16"),
                data=dict(seq_len=2048, global_batch=4)),
}


def parse(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny model and few repetitions (smoke run)")
  p.add_argument("--gpu", action="store_true", help="~1B Llama in bf16 on one GPU, MFU vs datasheet peak")
  p.add_argument("--layouts", default="all", help=f"comma list, 'all' or 'none'; known: {','.join(LAYOUTS)}")
  p.add_argument("--reps", type=int, default=None, help="paired repetitions (default 7; quick 5)")
  p.add_argument("--steps", type=int, default=None, help="steps per timed block (default 3; quick 5)")
  p.add_argument("--layout-reps", type=int, default=None, help="paired repetitions per layout (default 3)")
  p.add_argument("--pin", action="store_true",
                 help="one core + single-threaded XLA kernels: CPU-time ratios then count work only (shared host)")
  p.add_argument("--json", default=None,
                 help="where the result goes (default: the committed benchmarks/data/train_step.json for the default "
                      "model and --layouts none; none for --quick / --gpu / other layouts; '' for none)")
  args, rest = p.parse_known_args(argv)
  bad = [a for a in rest if not a.startswith("--config.")]
  if bad:
    p.error(f"unrecognised arguments {bad} (config overrides look like --config.model.n_layers=4)")
  args.overrides = rest
  args.reps = args.reps or (5 if args.quick else 3 if args.gpu else 7)
  args.steps = args.steps or (5 if args.quick else 3)
  args.layout_reps = args.layout_reps or (2 if args.quick else 3)
  names = [] if (args.gpu or args.layouts == "none") else list(LAYOUTS) if args.layouts == "all" else \
      [s.strip() for s in args.layouts.split(",") if s.strip()]
  unknown = [n for n in names if n not in LAYOUTS]
  if unknown:
    p.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
  args.layout_names = names
  return args


def _set_env(args):
  """Before jax is imported: 8 emulated CPU devices (CPU mode), CPU platform unless --gpu."""
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  if not args.gpu:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    xla_flags.set_host_device_count(8, keep_existing=True)  # a count the caller set on purpose wins
  if args.pin:
    # Every thread created from now on (XLA's executor, the emulated devices' threads) runs on one core;
    # with single-threaded kernels no worker spins waiting for work, so process CPU time is work done.
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    if "multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()


def _log(msg):
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_config(args):
  base = MODELS["gpu" if args.gpu else "quick" if args.quick else "cpu"]
  d = dict(name="bench_train_step", model=dict(base["model"]), data=dict(base["data"]),
           optim=dict(warmup_steps=2), checkpoint=dict(every=0),
           train=dict(steps=1000, progress=False, sample_tokens=0))
  cd = ml_collections.ConfigDict(d)
  for section in ("mesh", "optim", "train", "checkpoint"):  # so every known key can be overridden
    cd[section] = ml_collections.ConfigDict({**_defaults(section), **d.get(section, {})})
  for section in ("model", "data"):
    cd[section] = ml_collections.ConfigDict({**_defaults(section), **d[section]})
  cd.lock()
  config_file.apply_overrides(cd, args.overrides)
  return from_dict(cd)


def _defaults(section):
  c = config_lib
  cls = {"model": c.ModelConfig, "data": c.DataConfig, "optim": c.OptimConfig, "mesh": c.MeshConfig,
         "train": c.TrainConfig, "checkpoint": c.CheckpointConfig}[section]
  return {f.name: (list(f.default) if isinstance(f.default, tuple) else f.default) for f in dataclasses.fields(cls)}


def hyper(cfg):
  """The plain step's hyper-parameters, from the same config the framework uses."""
  from benchmarks import plain_llama  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  m, o = cfg.model, cfg.optim
  warmup = max(o.warmup_steps, 1)  # as framework/optim.py resolves them
  decay = max(o.decay_steps or cfg.train.steps, o.warmup_steps + 1)
  return plain_llama.Hyper(
      vocab=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
      head_dim=m.hd, d_ff=m.ff, rope_theta=m.rope_theta, norm_eps=m.norm_eps, tie=m.tie_embeddings, dtype=m.dtype,
      lr=o.lr, warmup=warmup, decay_steps=decay, min_lr_ratio=o.min_lr_ratio, b1=o.b1, b2=o.b2, eps=o.eps,
      weight_decay=o.weight_decay, grad_clip=o.grad_clip)


def hlo_stats(compiled) -> dict:
  """XLA's FLOP/byte counts and a few op counts of a compiled step (load-independent evidence)."""
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
  text = compiled.as_text()
  ops = {op: text.count(f" {op}(") for op in ("dot", "convolution", "fusion", "copy", "transpose", "all-reduce",
                                              "all-gather", "reduce-scatter", "collective-permute", "while")}
  # Note: XLA's cost analysis counts a while loop's body once (not times its trip count), so with
  # scanned layers xla_flops is far below the true count; compare it between the two steps only.
  return {"xla_flops": float(ca.get("flops", 0.0)), "xla_bytes": float(ca.get("bytes accessed", 0.0)), "ops": ops}


class Timing:
  """Wall and process CPU seconds (all threads) per step. On a shared, oversubscribed host wall time
  includes waiting for a core; CPU time does not, so CPU-time ratios survive the load (up to
  thread-pool spinning, which inflates every CPU-time figure alike)."""

  def __init__(self, wall: float, cpu: float):
    self.wall, self.cpu = wall, cpu


def _timed(run, state, n):
  import jax  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  t, c = time.perf_counter(), time.process_time()
  for _ in range(n):
    state, metrics = run(state)
  jax.block_until_ready(metrics)
  return state, Timing((time.perf_counter() - t) / n, (time.process_time() - c) / n), metrics


def _band(xs):
  return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


_PROBES = {}


def _matmul_rate(platform_name, quick) -> Timing:
  """Dense matmul FLOP per wall second and per CPU second: best size of (1024, 2048) f32 on CPU (as
  framework/flops.py's probe, plus a larger size), 8192 bf16 on GPU; median over a few runs."""
  import jax  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  import jax.numpy as jnp  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  sizes, dtype = ((1024,) if quick else (1024, 2048), jnp.float32) if platform_name == "cpu" else \
      ((8192,), jnp.bfloat16)
  best = Timing(0.0, 0.0)
  for n in sizes:
    if n not in _PROBES:
      x = jax.device_put(jnp.ones((n, n), dtype), jax.devices()[0])
      f = jax.jit(lambda a: (a @ a) * (1.0 / a.shape[0]))
      f(x).block_until_ready()
      _PROBES[n] = (f, x)
    f, x = _PROBES[n]
    walls, cpus = [], []
    for _ in range(3 if quick else 5):
      t, c = time.perf_counter(), time.process_time()
      f(x).block_until_ready()
      walls.append(time.perf_counter() - t)
      cpus.append(time.process_time() - c)
    fl = 2.0 * n ** 3
    best = Timing(max(best.wall, fl / statistics.median(walls)), max(best.cpu, fl / statistics.median(cpus)))
  return best


def single_device(cfg, args, batch_np):
  import jax  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  from benchmarks import plain_llama  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  from framework import flops  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  from parallelism.mesh import make_mesh  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  from parallelism.step import build_step  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)

  dev = jax.devices()[0]
  cfg1 = config_lib.validate(dataclasses.replace(cfg, mesh=config_lib.MeshConfig()), 1)
  fw = build_step(cfg1, make_mesh(cfg1.mesh, devices=[dev]))
  fw_state = fw.init_state(jax.random.key(0))
  fw_batch = fw.put_batch(batch_np)
  hp = hyper(cfg1)
  p_state = plain_llama.init_state(jax.device_put(plain_llama.from_framework(jax.device_get(fw_state.params)), dev))
  p_tok, p_tgt = (jax.device_put(batch_np[k], dev) for k in ("inputs", "targets"))
  p_step = jax.jit(functools.partial(plain_llama.train_step, hp=hp), donate_argnums=(0,))
  run_fw = lambda s: fw(s, fw_batch)  # noqa: E731 - the training code path: CompiledStep.__call__
  run_plain = lambda s: p_step(s, p_tok, p_tgt)  # noqa: E731

  # Compile + agreement check: 3 steps each from identical parameters (step 1 has lr=0 by the warm-up
  # schedule; step 3's loss already reflects one real AdamW update on both sides).
  out = {"n_params": cfg.model.n_params(), "tokens_per_step": cfg.data.global_batch * cfg.data.seq_len}
  states = {"framework": fw_state, "plain": p_state}
  losses = {"framework": [], "plain": []}
  for name, run in (("framework", run_fw), ("plain", run_plain)):
    t = time.perf_counter()
    for i in range(3):
      states[name], m = run(states[name])
      losses[name].append(float(m.loss if name == "framework" else m["loss"]))
      if i == 0:
        out[f"{name}_first_step_s"] = time.perf_counter() - t  # compile + one step
  fw_state, p_state = states["framework"], states["plain"]
  out["loss_check"] = {"framework": losses["framework"], "plain": losses["plain"],
                       "max_abs_diff": max(abs(a - b) for a, b in zip(losses["framework"], losses["plain"]))}
  _log(f"losses framework {losses['framework']} plain {losses['plain']}")
  out["hlo"] = {"framework": hlo_stats(fw.lower().compile()),
                "plain": hlo_stats(p_step.lower(p_state, p_tok, p_tgt).compile())}

  t = {"framework": [], "plain": []}
  peaks = []
  for r in range(args.reps):
    peaks.append(_matmul_rate(dev.platform, args.quick))
    order = [("framework", run_fw), ("plain", run_plain)]
    if r % 2:  # alternate who goes first: neither always gets the warmer / quieter slot
      order.reverse()
    for name, run in order:
      if name == "framework":
        fw_state, tm, _ = _timed(run, fw_state, args.steps)
      else:
        p_state, tm, _ = _timed(run, p_state, args.steps)
      t[name].append(tm)
    _log(f"rep {r}: framework {t['framework'][-1].wall:.4f}s ({t['framework'][-1].cpu:.3f} cpu-s) "
         f"plain {t['plain'][-1].wall:.4f}s ({t['plain'][-1].cpu:.3f} cpu-s) "
         f"matmul {peaks[-1].wall / 1e9:.1f} GFLOP/s ({peaks[-1].cpu / 1e9:.1f} per cpu-s)")
  peaks.append(_matmul_rate(dev.platform, args.quick))

  flops_step = flops.train_flops_per_token(cfg.model, cfg.data.seq_len) * out["tokens_per_step"]
  out.update(flops_per_step=flops_step, flop_convention=flops.CONVENTION)
  for clock in ("wall", "cpu"):
    fw_x = [getattr(x, clock) for x in t["framework"]]
    pl_x = [getattr(x, clock) for x in t["plain"]]
    peak_x = [getattr(x, clock) for x in peaks]
    fw_med, pl_med, peak = statistics.median(fw_x), statistics.median(pl_x), statistics.median(peak_x)
    sfx = "" if clock == "wall" else "_cpu"  # *_cpu: per CPU-second of this process (load-robust)
    out.update({
        f"matmul_flops_per_s{sfx}": _band(peak_x),
        f"framework_step_s{sfx}": _band(fw_x), f"plain_step_s{sfx}": _band(pl_x),
        f"framework_over_plain{sfx}": _band([a / b for a, b in zip(fw_x, pl_x)]),
        f"framework_over_plain_of_medians{sfx}": fw_med / pl_med,
        f"achieved_flops_per_s{sfx}": flops_step / fw_med, f"plain_achieved_flops_per_s{sfx}": flops_step / pl_med,
        f"flops_over_matmul{sfx}": flops_step / fw_med / peak,
        f"plain_flops_over_matmul{sfx}": flops_step / pl_med / peak})
  out.update(tokens_per_s=out["tokens_per_step"] / out["framework_step_s"]["median"],
             plain_tokens_per_s=out["tokens_per_step"] / out["plain_step_s"]["median"])
  if dev.platform != "cpu":
    datasheet, src = flops.peak_flops()
    out.update(mfu=flops_step / out["framework_step_s"]["median"] / datasheet, peak_source=src,
               peak_flops=datasheet)
  return out, (fw, fw_state, run_fw)


def layouts(cfg, args, batch_np, single, single_first_loss: float):
  import jax  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  from parallelism.mesh import make_mesh  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  from parallelism.step import build_step  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)

  fw1, fw1_state, run1 = single
  tokens = cfg.data.global_batch * cfg.data.seq_len
  out = {}
  for name in args.layout_names:
    sizes, form, extra = LAYOUTS[name]
    t0 = time.perf_counter()
    try:
      mesh_cfg = dataclasses.replace(config_lib.MeshConfig(), form=form, **sizes, **extra)
      cfg8 = config_lib.validate(dataclasses.replace(cfg, mesh=mesh_cfg), jax.device_count())
      step = build_step(cfg8, make_mesh(cfg8.mesh))
      state = step.init_state(jax.random.key(0))
      batch = step.put_batch(batch_np)
      run = lambda s, step=step, batch=batch: step(s, batch)  # noqa: E731
      state, _, m = _timed(run, state, 1)  # compile + first step
      first_loss = float(m.loss)
      rec = {"mesh": sizes, "form": form, **extra, "first_step_s": time.perf_counter() - t0,
             "first_loss": first_loss, "first_loss_diff_vs_single": first_loss - single_first_loss}
      lt, ratios, cpu_ratios = [], [], []
      for r in range(args.layout_reps):
        state, t_l, _ = _timed(run, state, args.steps)
        fw1_state, t_1, _ = _timed(run1, fw1_state, args.steps)
        lt.append(t_l.wall)
        ratios.append(t_l.wall / t_1.wall)
        cpu_ratios.append(t_l.cpu / t_1.cpu)
      rec.update(step_s=_band(lt), tokens_per_s=tokens / statistics.median(lt), over_single_device=_band(ratios),
                 over_single_device_cpu=_band(cpu_ratios))
      _log(f"layout {name}: {statistics.median(lt):.4f}s/step, x{statistics.median(ratios):.2f} vs 1 device")
      del step, state, batch, run
    except Exception as e:  # noqa: BLE001 - a layout that cannot run is a result, recorded with its reason
      rec = {"mesh": sizes, "form": form, **extra, "error": f"{type(e).__name__}: {str(e)[:400]}"}
      _log(f"layout {name}: ERROR {rec['error']}")
    out[name] = rec
    gc.collect()
  return out, fw1_state


def machine() -> str:
  model = platform.processor() or platform.machine()
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        model = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return f"{model}, {os.cpu_count()} cores"


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  args = parse(argv)
  _set_env(args)
  import jax  # noqa: PLC0415 (loads jax: after _set_env's platform, device count and pinning)
  import numpy as np  # noqa: PLC0415 (starts a thread: after _set_env's pinning)

  if args.gpu and jax.devices()[0].platform != "gpu":
    print(json.dumps({"skipped": f"--gpu needs a GPU; jax sees {jax.devices()[0].platform}"}))
    return 0
  cfg = build_config(args)
  res = {"benchmark": "train_step", "command": provenance.command("benchmarks.train_step", argv),
         "machine": f"{machine()}, {jax.devices()[0].platform}", "date": provenance.now(), "jax": jax.__version__,
         "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "devices": jax.device_count(), "platform": jax.devices()[0].platform, "pinned": args.pin, "quick": args.quick,
         "cores": len(os.sched_getaffinity(0)),
         "load_avg_start": os.getloadavg()[0], "model": cfg.model.__dict__,
         "seq_len": cfg.data.seq_len, "global_batch": cfg.data.global_batch, "reps": args.reps, "steps": args.steps}
  rng = np.random.default_rng(0)
  win = rng.integers(0, cfg.model.vocab_size, size=(cfg.data.global_batch, cfg.data.seq_len + 1)).astype(np.int32)
  batch_np = {"inputs": win[:, :-1], "targets": win[:, 1:]}
  _log(f"model {cfg.model.n_params() / 1e6:.1f}M params, batch {cfg.data.global_batch}x{cfg.data.seq_len}, "
       f"{jax.device_count()} {res['platform']} devices, load {res['load_avg_start']:.1f}")
  res["single"], single = single_device(cfg, args, batch_np)
  if args.layout_names:
    res["layouts"], _ = layouts(cfg, args, batch_np, single, res["single"]["loss_check"]["framework"][0])
  res["load_avg_end"] = os.getloadavg()[0]
  print(json.dumps(res, indent=1, default=str))
  path = args.json
  if path is None and not (args.quick or args.gpu or args.overrides) and not args.layout_names:
    path = str(REPO / "benchmarks" / "data" / "train_step.json")
  if path:
    with open(path, "w") as f:
      json.dump(res, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
