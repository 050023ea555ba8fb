"""prima.cpp (arXiv 2504.08791) figures, drawn only from committed data under benchmarks/data/.

* ``primacpp_systems``: TPOT per system on the same model and the same four emulated devices
  (benchmarks/ondevice_devices4.yaml): every device alone with llama.cpp-style mmap (the best one is the
  baseline), exo-like RAM-proportional split, dllama-like tensor parallel, prima.cpp's runtime on Halda's
  windows, and ours (Halda + pipelined ring). Data: ondevice_ring.json (``python -m ondevice.bench --suite
  ring --scenarios all``); the clock is EMULATED (real compute x slowdown, page-cache and disk emulation), so
  host load moves it only through the measured layer time. Paper: 5-17x lower TPOT than the baselines.
* ``primacpp_model_sizes`` (committed as benchmarks/ondevice_latency.png): the same comparison over model sizes
  (4, 8, 16 layers), experiments/figures/ondevice_latency.py's sweep and plot. Data: ondevice_latency.json.
* ``primacpp_halda_paper``: Halda's plan (planning only, ondevice/halda.py) on the paper's Table 1 devices for
  Llama 3-8B, 1-30B, 1-65B and 3-70B, next to the paper's Table 2 latencies (llama.cpp and prima.cpp). The
  paper's numbers and every input the paper does not give (memory bandwidths, bits per weight, shapes) are in
  primacpp_paper.json, each with its source. Source of the paper's numbers: prima.cpp arXiv 2504.08791 v1,
  Tables 1-2 (also github.com/Lizonghang/prima.cpp README).
* ``primacpp_ring_k``: TPOT and disk reads per token vs ring cycles k with Halda's windows for each fixed k,
  under Halda's residency (pin / prefetch / stream) and under prima.cpp's runtime (whole next window read
  ahead, LRU). Data: ondevice_ksweep.json (``--rerun ksweep``, emulated clock).
* ``primacpp_spec``: speculative decoding speed-up vs draft length on real text (stdlib source prompts) with
  acceptance < 1, wall clock. Data: ondevice_spec.json (``python -m ondevice.bench --suite spec``).

  python -m experiments.figures.primacpp [--out-dir DIR]
  nice -n 10 python -m experiments.figures.primacpp --rerun ksweep|sizes   # minutes; rewrites the data
  python -m experiments.figures.primacpp --store ring|spec OUT.json  # keep an ondevice.bench output
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import tempfile

from experiments.figures import registry
from experiments.figures.registry import MissingData, figure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "benchmarks", "data")
RING, KSWEEP, SPEC, PAPER = "ondevice_ring.json", "ondevice_ksweep.json", "ondevice_spec.json", "primacpp_paper.json"
SIZES = "ondevice_latency.json"
DEVICES4 = "benchmarks/ondevice_devices4.yaml"
PAPER_NAME, SRC, _D = "prima.cpp", "arXiv 2504.08791", "benchmarks/data/"
RERUN = {
    RING: ("python -c \"from experiments.figures.primacpp import small_model; small_model('/tmp/small_q8.gguf')\" && "
           "nice -n 10 python -m ondevice.bench --model /tmp/small_q8.gguf --suite ring --devices "
           "benchmarks/ondevice_devices4.yaml --tokens 24 --scenarios all > /tmp/ring.json && "
           "python -m experiments.figures.primacpp --store ring /tmp/ring.json"),
    KSWEEP: "nice -n 10 python -m experiments.figures.primacpp --rerun ksweep",
    SIZES: "nice -n 10 python -m experiments.figures.primacpp --rerun sizes",
    SPEC: ("nice -n 10 python -m ondevice.bench --model T.gguf --suite spec --draft D.gguf --tokens 48 --gammas 1,2,4 "
           "> /tmp/spec.json && python -m experiments.figures.primacpp --store spec /tmp/spec.json "
           "(T, D: experiments/configs/ondevice_spec.py)"),
    PAPER: "python -m experiments.figures.primacpp --plan-paper",  # Halda plans, nothing runs: the data is the paper's
}
SYSTEMS = [("exo_like_memory_split", "exo-like\nRAM split", "tab:orange"),
           ("dllama_like_tensor_parallel", "dllama-like\ntensor par.", "tab:purple"),
           ("equal_layers_split", "equal layers\n(k=1)", "tab:brown"),
           ("prima_runtime_kauto", "prima.cpp runtime\non Halda's windows", "tab:olive"),
           ("halda_ring", "ours: Halda +\npipelined ring", "tab:green")]


def _load(name, data_dir=DATA):
  path = os.path.join(data_dir, name)
  if not os.path.exists(path):
    how = " (the paper's numbers, committed by hand)" if name == PAPER else f"; run `{RERUN[name]}` to produce it"
    raise MissingData(f"{_D}{name} is missing{how}")
  with open(path) as f:
    return json.load(f)


def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


# ------------------------------------------------------------------ systems on the same devices

@figure("primacpp_systems", paper=PAPER_NAME, data=[_D + RING], rerun=RERUN[RING],
        paper_number=f"5-17x lower TPOT than llama.cpp, exo, dllama; 70B: 674 vs 10120 ms for llama.cpp ({SRC})")
def draw_systems(out_path: str, data_dir: str = DATA) -> dict:
  plt = _plt()
  d = _load(RING, data_dir)
  r = d["result"]["ring"]
  alone = sorted(k for k in r if k.startswith("alone_"))
  names = [(k, f"{k[6:]} alone\n(mmap, LRU)", "tab:gray") for k in alone] + SYSTEMS
  ys = [r[k]["tpot_ms"] for k, _, _ in names]
  best = r[f"alone_{r['best_single_device']}"]["tpot_ms"]
  fig, ax = plt.subplots(figsize=(11, 4.6))
  cols = [("k" if k == f"alone_{r['best_single_device']}" else c) for k, _, c in names]
  ax.bar(range(len(names)), ys, color=cols)
  for i, (k, _, _) in enumerate(names):
    row = r[k]
    extra = f"\nk={row['k']} w={row['w']}" if row.get("w") else ""
    ax.text(i, ys[i], f"{ys[i]:.0f} ms\n{best / ys[i]:.2f}x{extra}", ha="center", va="bottom", fontsize=7)
  ax.axhline(best, color="k", ls=":", lw=0.8)
  ax.set_xticks(range(len(names)), [n for _, n, _ in names], fontsize=7)
  ax.set_ylabel("TPOT (ms per token, EMULATED clock)")
  ax.set_ylim(0, max(ys) * 1.3)
  ax.set_title(f"prima.cpp: TPOT per system, same model ({d['result']['model'].split(':')[0]}, 8 layers Q8_0, 6.6 MiB "
               f"> all RAM) on 4 emulated devices;\nbaseline (black) = best single device {r['best_single_device']}; "
               f"label: speed-up vs it. Host load avg {d['result']['load_avg']:.1f} (moves only the measured layer time, "
               f"{r['measured_layer_ms']:.3f} ms). Paper: 5-17x vs baselines", fontsize=8)
  fig.tight_layout()
  fig.savefig(out_path, dpi=120)
  plt.close(fig)
  h = r["halda_ring"]["tpot_ms"]
  ours = (f"Halda + ring {h:.0f} ms vs best single device {best:.0f} ms ({r['speedup_vs_best_single_device']:.2f}x), "
          f"exo-like {r['speedup_vs_exo_like']:.1f}x, dllama-like {r['speedup_vs_dllama_like']:.1f}x slower (emulated clock)")
  return {"ours": ours, "best_single_device": r["best_single_device"], "best_single_ms": round(best, 1),
          **{k: round(r[k]["tpot_ms"], 1) for k, _, _ in SYSTEMS},
          "speedup_vs_best_single": round(r["speedup_vs_best_single_device"], 2),
          "speedup_vs_exo_like": round(r["speedup_vs_exo_like"], 2),
          "speedup_vs_dllama_like": round(r["speedup_vs_dllama_like"], 2), "load_avg": round(d["result"]["load_avg"], 1)}


@figure("primacpp_model_sizes", paper=PAPER_NAME, data=[_D + SIZES], rerun=RERUN[SIZES], out="benchmarks/ondevice_latency.png",
        paper_number=f"the lead grows with model size: 8B 54 vs 15 ms (llama.cpp), 70B 674 vs 10120 ms (Table 2, {SRC})")
def draw_model_sizes(out_path: str, data_dir: str = DATA) -> dict:
  """experiments/figures/ondevice_latency.py's model-size sweep, from its committed output."""
  from experiments.figures import ondevice_latency
  d = _load(SIZES, data_dir)
  ondevice_latency.plot(d["runs"], out_path)
  rows = {}
  for run in d["runs"]:
    ring = run["ring"]
    rows[run["model"]] = {s: round(ondevice_latency._tpot(ring, s), 1) for s, _ in ondevice_latency.SCEN}
  ours = "; ".join(f"{m.split(' ')[0]}: best single {v['best_single']:.0f} ms, Halda ring {v['halda_ring']:.0f} ms "
                   f"({v['best_single'] / v['halda_ring']:.1f}x)" for m, v in rows.items())
  return {"ours": ours + f" (emulated clock, load {d['load_avg']:.1f})", **rows}


def rerun_sizes(data_dir: str = DATA, layers=(4, 8, 16), tokens: int = 12) -> str:
  from experiments.figures import ondevice_latency
  with tempfile.TemporaryDirectory() as td:
    runs = ondevice_latency.sweep(list(layers), os.path.join(ROOT, DEVICES4), tokens, td)
  out = os.path.join(data_dir, SIZES)
  with open(out, "w") as f:
    json.dump({"date": datetime.datetime.now().isoformat(timespec="minutes"), "load_avg": os.getloadavg()[0],
               "tokens": tokens, "devices": DEVICES4, "command": RERUN[SIZES], "machine": _machine(), "runs": runs},
              f, indent=1)
  return out


# ------------------------------------------------------------------ Halda on the paper's devices

def paper_inputs(p: dict):
  """Halda's DeviceCost / ModelCost for each model from the paper's Table 1 and the stated assumptions."""
  from ondevice import halda
  a = p["not_in_the_paper"]
  bpw = a["bits_per_weight"]["value"] / 8
  GiB = 2.0 ** 30
  out = {}
  for name, m in a["models"].items():
    hd = m["d"] // m["heads"]
    layer_params = 2 * m["d"] * m["d"] + 2 * m["d"] * m["kv_heads"] * hd + 3 * m["d"] * m["ffn"]
    layer_b = layer_params * bpw
    kv = 2 * m["kv_heads"] * hd * a["ctx"]["value"] * 2  # K and V, f16
    devs = []
    for dv in p["devices"]:
      bw = a["mem_gbps"][dv["name"]]
      gpu = bw.get("gpu") if dv["vram_gib"] else None
      devs.append(halda.DeviceCost(dv["name"], t_cpu_layer_s=layer_b / (bw["cpu"] * 1e9), ram_bytes=dv["ram_gib"] * GiB,
                                   disk_Bps=dv["disk_gbps"] * 1e9, t_gpu_layer_s=layer_b / (gpu * 1e9) if gpu else 0.0,
                                   vram_bytes=dv["vram_gib"] * GiB, link_s=a["link_s"]["value"]))
    head_s = m["vocab"] * m["d"] * bpw / (a["mem_gbps"][p["devices"][0]["name"]]["cpu"] * 1e9)
    out[name] = (devs, halda.ModelCost(m["layers"], int(layer_b), kv, head_s), layer_b)
  return out


@functools.lru_cache(maxsize=4)  # a few seconds of MILPs; the inputs are a committed file
def halda_paper_plans(data_dir: str = DATA) -> dict:
  from ondevice import halda
  p = _load(PAPER, data_dir)
  rows = {}
  for name, (devs, model, layer_b) in paper_inputs(p).items():
    plan = halda.solve(devs, model)
    singles = {}
    for dv in devs:  # one device alone, Halda's residency (k=1): our analogue of the llama.cpp column
      q = halda.solve_k([dv], model, 1)
      singles[dv.name] = 1e3 * q.latency_s if q else None
    best = min((v, k) for k, v in singles.items() if v is not None)
    rows[name] = {"halda_ms": 1e3 * plan.latency_s, "k": plan.k, "w": list(plan.w), "n_gpu": list(plan.n),
                  "used": [devs[i].name for i in plan.used], "disk_mb_per_token": plan.disk_bytes_per_token() / 2**20,
                  "halda_best_single_ms": best[0], "best_single": best[1], "layer_mb": layer_b / 2**20,
                  "paper": p["token_latency_ms"][name]}
  return rows


@figure("primacpp_halda_paper", paper=PAPER_NAME, data=[_D + PAPER], rerun=RERUN[PAPER],
        paper_number=f"prima.cpp 54 / 72 / 569 / 674 ms for Llama 3-8B / 1-30B / 1-65B / 3-70B (Table 2, {SRC})")
def draw_halda_paper(out_path: str, data_dir: str = DATA) -> dict:
  plt = _plt()
  rows = halda_paper_plans(data_dir)
  names = list(rows)
  fig, ax = plt.subplots(figsize=(10, 4.8))
  series = [("paper: llama.cpp (one device)", lambda r: r["paper"]["llama.cpp"], "tab:gray"),
            ("paper: prima.cpp (measured)", lambda r: r["paper"]["prima.cpp"], "tab:blue"),
            ("Halda model: best device alone, k=1", lambda r: r["halda_best_single_ms"], "silver"),
            ("Halda model: plan on 4 devices", lambda r: r["halda_ms"], "tab:green")]
  w = 0.2
  for j, (lab, f, col) in enumerate(series):
    xs = [i + (j - 1.5) * w for i in range(len(names))]
    ys = [f(rows[n]) for n in names]
    ax.bar(xs, ys, w, label=lab, color=col)
    for x, y in zip(xs, ys):
      ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=6)
  for i, n in enumerate(names):
    r = rows[n]
    ax.text(i, 1.5, f"k={r['k']} w={r['w']}\ngpu={r['n_gpu']}\ndisk {r['disk_mb_per_token']:.0f} MB/token", ha="center",
            fontsize=6, color="darkgreen")
  ax.set_yscale("log")
  ax.set_xticks(range(len(names)), names)
  ax.set_ylabel("ms per token (log)")
  ax.set_ylim(1, None)
  ax.legend(fontsize=7, loc="upper left")
  ax.set_title("Halda (planning only) on prima.cpp's Table 1 devices vs the paper's Table 2 latencies (Q4K).\n"
               "Layer times = Q4_K bytes / vendor memory bandwidth (lower bound), links free as in prima.cpp's cost; Halda selects "
               "devices, the paper's table does not.\nInputs and sources: benchmarks/data/primacpp_paper.json", fontsize=8)
  fig.tight_layout()
  fig.savefig(out_path, dpi=120)
  plt.close(fig)
  ours = "Halda's model on the paper's devices: " + " / ".join(f"{r['halda_ms']:.0f}" for r in rows.values()) + " ms"
  return {"ours": ours, **{n: {"halda_ms": round(r["halda_ms"], 1), "paper_prima_ms": r["paper"]["prima.cpp"],
              "paper_llamacpp_ms": r["paper"]["llama.cpp"], "halda_best_single_ms": round(r["halda_best_single_ms"], 1),
              "k": r["k"], "w": r["w"], "n_gpu": r["n_gpu"]} for n, r in rows.items()}}


# ------------------------------------------------------------------ ring cycles k

def small_model(path: str, n_layers: int = 8) -> str:
  """The random-weight "small" Q8_0 model of the ring suite (L=8 D=256 H=8/4 F=768 V=256, 6.6 MiB)."""
  import jax
  from framework import model as fm
  from framework.config import ModelConfig
  from ondevice import gguf_io
  cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=n_layers, n_heads=8, n_kv_heads=4, d_ff=768,
                    max_seq_len=512, init_std=0.02)
  with jax.numpy_rank_promotion("allow"):
    params = fm.init_params(fm.build(cfg), jax.random.key(0))
  gguf_io.export_gguf(params, cfg, path, "q8_0", name=f"small_L{n_layers}")
  return path


def sweep_k(path: str, devices: str, ks, n: int = 24, prompt: bytes = b"def fibonacci(n):\n    ") -> dict:
  """Halda's windows at each fixed k, run on the emulated ring under Halda's residency and prima.cpp's runtime."""
  from ondevice import generate, planner, profiler
  from ondevice.device import DeviceOptions
  from ondevice.emulation import load_devices
  from ondevice.gguf_io import describe, read_info
  from ondevice.ring import RingEngine
  info = read_info(path)
  specs = load_devices(devices)["devices"]
  layer_s, head_s = profiler.layer_time(path), profiler.head_time(path)
  toks = list(prompt)
  ctx = len(toks) + n + 8
  rows = []
  for k in ks:
    try:
      p, kept = planner.plan(info, specs, "halda", k, layer_s, head_s, ctx)
    except ValueError as e:  # no feasible plan at this k
      rows.append({"k": k, "runtime": "none", "error": str(e)})
      continue
    for runtime, policy in (("halda", "plan"), ("prima_runtime", "os")):
      opts = DeviceOptions(prefetch=True, policy=policy, chunk_bytes=4096, max_len=ctx)
      with RingEngine(path, p.windows, kept, opts, n_gpu=p.n_gpu, residency=p.residency if policy == "plan" else None) as e:
        st = generate.greedy(e, toks, n)
        stats = e.stats()
      rows.append({**p.as_dict(), "runtime": runtime, "devices": [s.name for s in kept], "tpot_ms": st.as_dict()["tpot_ms"],
                   "disk_read_mb_per_token": sum(s.get("emulated_disk_read_mb", 0) for s in stats) / n})
      print(json.dumps(rows[-1]), flush=True)
  return {"model": describe(info), "devices": devices, "tokens": n, "clock": "emulated", "measured_layer_ms": 1e3 * layer_s,
          "rows": rows}


@figure("primacpp_ring_k", paper=PAPER_NAME, data=[_D + KSWEEP], rerun=RERUN[KSWEEP],
        paper_number=f"piped ring with k > 1 and prefetching hides disk loading ({SRC})")
def draw_ring_k(out_path: str, data_dir: str = DATA) -> dict:
  plt = _plt()
  d = _load(KSWEEP, data_dir)
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4.2))
  summary = {}
  for runtime, lab, col in (("halda", "Halda residency (ours)", "tab:green"),
                            ("prima_runtime", "prima.cpp runtime (read whole window ahead, LRU)", "tab:olive")):
    rs = sorted((r for r in d["rows"] if r["runtime"] == runtime), key=lambda r: r["k"])
    ks = [r["k"] for r in rs]
    a1.plot(ks, [r["tpot_ms"] for r in rs], "o-", color=col, label=lab)
    a2.plot(ks, [r["disk_read_mb_per_token"] for r in rs], "o-", color=col, label=lab)
    summary[runtime] = {r["k"]: {"tpot_ms": round(r["tpot_ms"], 1), "disk_mb": round(r["disk_read_mb_per_token"], 2)}
                        for r in rs}
    if runtime == "halda":
      a1.plot(ks, [r["halda_model_latency_ms"] for r in rs], "x--", color="k", label="Halda's predicted TPOT")
      a2.plot(ks, [r["halda_model_disk_mb_per_token"] for r in rs], "x--", color="k", label="Halda's predicted reads")
      a1.plot(ks, [r["prima_cost_ms"] for r in rs], "+:", color="tab:olive", label="prima.cpp's cost model, same windows")
      for r in rs:
        a1.annotate(f"w={r['w']}", (r["k"], r["tpot_ms"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
  for ax, yl in ((a1, "TPOT (ms, EMULATED clock)"), (a2, "disk reads per token (MB)")):
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("ring cycles per token k")
    ax.set_ylabel(yl)
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  hs, ps = summary["halda"], summary["prima_runtime"]
  j = lambda rows, key, fmt: " / ".join(fmt.format(v[key]) for v in rows.values())  # noqa: E731
  summary["ours"] = (f"k = {' / '.join(str(k) for k in hs)}: TPOT {j(hs, 'tpot_ms', '{:.0f}')} ms (prima.cpp's runtime "
                     f"{j(ps, 'tpot_ms', '{:.0f}')}), disk {j(hs, 'disk_mb', '{:.1f}')} MB/token (emulated clock)")
  fig.suptitle(f"prima.cpp: TPOT and disk reads vs ring cycles k ({d['model'].split(':')[0]}, 4 emulated devices; "
               f"load avg {d['load_avg']:.1f}, {d['date']})", fontsize=9)
  fig.tight_layout()
  fig.savefig(out_path, dpi=120)
  plt.close(fig)
  return summary


# ------------------------------------------------------------------ speculative decoding

@figure("primacpp_spec", paper=PAPER_NAME, data=[_D + SPEC], rerun=RERUN[SPEC],
        paper_number=f"32B with speculative decoding: 26 tokens/s ({SRC} v2)")
def draw_spec(out_path: str, data_dir: str = DATA) -> dict:
  plt = _plt()
  d = _load(SPEC, data_dir)
  fig, ax = plt.subplots(figsize=(8, 4.4))
  summary = {}
  for i, (run, col) in enumerate(zip(d["runs"], ("tab:red", "tab:blue", "tab:green", "tab:purple"))):
    s = run["result"]["spec"]
    gs = sorted(int(k[5:]) for k in s if k.startswith("gamma"))
    sp = [s[f"gamma{g}"]["speedup"] for g in gs]
    acc = [s[f"gamma{g}"]["acceptance"] for g in gs]
    lab = f"{run['date']} ({run['label']}), load avg {run['result']['load_avg']:.1f}"
    ax.plot(gs, sp, "o-", color=col, label=lab)
    for g, y, a in zip(gs, sp, acc):
      ax.annotate(f"acc {a:.2f}", (g, y), fontsize=7, xytext=(4, (6, -12)[i % 2]), textcoords="offset points", color=col)
    summary[run["date"]] = {g: {"speedup": round(y, 6), "acceptance": round(a, 6)} for g, y, a in zip(gs, sp, acc)}
  summary["ours"] = "; ".join(
      f"{min(v['speedup'] for v in x.values()):.2f}-{max(v['speedup'] for v in x.values()):.2f}x at acceptance "
      f"{min(v['acceptance'] for v in x.values()):.2f}-{max(v['acceptance'] for v in x.values()):.2f} ({run})"
      for run, x in summary.items())
  ax.axhline(1.0, color="k", lw=0.8, ls=":")
  ax.set_xlabel("draft length gamma (tokens)")
  ax.set_ylabel("speed-up over greedy decoding (x, wall clock)")
  ax.set_ylim(0, None)
  ax.legend(fontsize=7)
  ax.set_title("prima.cpp: speculative decoding vs draft length on stdlib source prompts (same 8-layer target,\n"
               "2-layer draft, byte tokens; output identical to greedy). Paper: 26 tokens/s on a 32B model", fontsize=8)
  fig.tight_layout()
  fig.savefig(out_path, dpi=120)
  plt.close(fig)
  return summary


DRAW = {"primacpp_systems": draw_systems, "primacpp_model_sizes": draw_model_sizes, "primacpp_halda_paper": draw_halda_paper, "primacpp_ring_k": draw_ring_k,
        "primacpp_spec": draw_spec}


def _machine() -> str:
  return f"{platform.machine()} {os.cpu_count()} cores (shared)"


def rerun_ksweep(data_dir: str = DATA, ks=(1, 2, 4, 8), tokens: int = 24) -> str:
  with tempfile.TemporaryDirectory() as td:
    res = sweep_k(small_model(os.path.join(td, "small_L8_q8_0.gguf")), os.path.join(ROOT, DEVICES4), ks, tokens)
  res.update(devices=DEVICES4, load_avg=os.getloadavg()[0], date=datetime.date.today().isoformat(),
             command="nice -n 10 python -m experiments.figures.primacpp --rerun ksweep", machine=_machine())
  out = os.path.join(data_dir, KSWEEP)
  with open(out, "w") as f:
    json.dump(res, f, indent=1)
  return out


def store(kind: str, src: str, label: str = "", data_dir: str = DATA) -> str:
  """Keep a `python -m ondevice.bench` JSON output as figure data: the ring run replaces ondevice_ring.json, a spec
  run is added to ondevice_spec.json's runs (dated, with the load average it ran under)."""
  with open(src) as f:
    res = json.load(f)
  now = datetime.datetime.now().isoformat(timespec="minutes")
  if kind == "ring":
    out, d = os.path.join(data_dir, RING), {"date": now, "command": RERUN[RING], "machine": _machine(), "result": res}
  else:
    out = os.path.join(data_dir, SPEC)
    with open(out) as f:
      d = json.load(f)
    d["runs"].append({"date": now, "command": "python -m ondevice.bench --suite spec", "machine": _machine(),
                      "label": label or res["model"], "result": res})
  with open(out, "w") as f:
    json.dump(d, f, indent=1)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--rerun", choices=["ksweep", "sizes"], help="re-measure that data file at this host's scale first")
  ap.add_argument("--store", nargs=2, metavar=("ring|spec", "JSON"), help="keep an ondevice.bench output as data")
  ap.add_argument("--label", default="", help="--store spec: the pair's label in the figure")
  ap.add_argument("--plan-paper", action="store_true", help="print Halda's plans on the paper's devices and exit")
  ap.add_argument("--out-dir", default=None, help="write DIR/NAME.png instead of each figure's committed path")
  a = ap.parse_args(argv)
  if a.plan_paper:
    print(json.dumps(halda_paper_plans(DATA), indent=1))
    return
  if a.rerun:
    print(rerun_ksweep() if a.rerun == "ksweep" else rerun_sizes())
  if a.store:
    print(store(a.store[0], a.store[1], a.label))
  for name, fn in DRAW.items():
    out = os.path.join(a.out_dir, f"{name}.png") if a.out_dir else os.path.join(ROOT, registry.FIGURES[name].out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    print(out, fn(out)["ours"])


if __name__ == "__main__":
  main()
