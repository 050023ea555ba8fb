"""PHOENIX / DeadPool (hot swap, arXiv 2607.01646) figures, drawn only from committed data under benchmarks/data/.

* ``phoenix_overhead``: failure-free step time with the snapshot layer on and off, one box per side over the
  5-step blocks of run A (the layer alternates on/off in the same processes), for the tiny (--quick) and the
  3.3M-param model; the bootstrap CI of the median ratio is in the title. Paper: zero overhead.
* ``phoenix_recovery``: recovery time split into detect / rebuild / restore / recompile / first step, median
  per injected failure kind over runs C (calibration) and B (random campaign). Paper: recovery < 40 s.
* ``phoenix_loss``: loss vs wall time of the runs with failures (C: 12 injected, B: 65 injected) over the
  failure-free run A; injections marked. The per-step losses are bit-identical (trajectory_identical).
* ``phoenix_goodput``: goodput vs node MTBF of disk checkpoint/restart, in-memory + restart and hot swap
  (resilience/goodput.py, Daly's model), (a) at this host's scale from costs measured by
  `python -m benchmarks.hotswap`, with run B's measured and predicted goodput as points, and (b) projected to
  512 GPUs / 65B from benchmarks/data/hotswap_projection_65b_512.json, whose every cost states its source.

Data: benchmarks/data/hotswap_quick.json and hotswap_full.json (the JSON `python -m benchmarks.hotswap` writes) and
hotswap_runs.json (per-step and per-recovery records extracted from its workdirs by ``--collect``).
Re-measure at this host's scale (about 20 minutes on 2 busy cores), then extract:

  nice -n 10 python -m benchmarks.hotswap --quick --failures 50 --steps 150 --probe-block 5 \\
      --workdir /tmp/hs50 > /tmp/hs50.json
  nice -n 10 python -m benchmarks.hotswap --failures 5 --steps 60 --probe-block 5 \\
      --workdir /tmp/hsfull > /tmp/hsfull.json
  python -m experiments.figures.phoenix --collect /tmp/hs50.json /tmp/hsfull.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from experiments.figures import registry
from experiments.figures.registry import MissingData, figure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "benchmarks", "data")
BENCH = {"quick": "hotswap_quick.json", "full": "hotswap_full.json"}
RUNS = "hotswap_runs.json"
PROJ = "hotswap_projection_65b_512.json"
PARTS = ["detect", "rebuild", "restore", "recompile", "first_step"]
KINDS = ["worker", "node", "replication", "hang", "recovery"]
STRATS = [("disk_checkpoint_restart", "disk checkpoint + restart", "tab:red"),
          ("in_memory_restart", "in-memory + job restart", "tab:orange"),
          ("hotswap", "hot swap (spare node)", "tab:green")]
PAPER = "PHOENIX"
PAPER_SRC = "DeadPool, arXiv 2607.01646"
_D = "benchmarks/data/"
COLLECT = ("nice -n 10 python -m benchmarks.hotswap --quick --failures 50 --steps 150 --probe-block 5 "
           "--workdir /tmp/hs50 > /tmp/hs50.json && nice -n 10 python -m benchmarks.hotswap --failures 5 --steps 60 "
           "--probe-block 5 --workdir /tmp/hsfull > /tmp/hsfull.json && "
           "python -m experiments.figures.phoenix --collect /tmp/hs50.json /tmp/hsfull.json")
RERUN = {"quick": "python -m benchmarks.hotswap --quick --failures 50 --steps 150 --probe-block 5 --workdir W",
         "full": "python -m benchmarks.hotswap --failures 5 --steps 60 --probe-block 5 --workdir W"}


def _load(name, data_dir=DATA):
  path = os.path.join(data_dir, name)
  if not os.path.exists(path):
    raise MissingData(f"{_D}{name} is missing; run `{COLLECT}` to produce it")
  with open(path) as f:
    return json.load(f)


def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


# ------------------------------------------------------------------ extraction from benchmark workdirs

def _jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _run_records(wd: str) -> dict:
  """One workdir of benchmarks/hotswap.py: step log, losses over time, injections, recoveries."""
  with open(os.path.join(wd, "hotswap_summary.json")) as f:
    s = json.load(f)
  met = _jsonl(os.path.join(wd, "metrics.jsonl"))
  t0 = min(m["t"] for m in met)
  first_t = {}
  for m in met:
    first_t.setdefault(m["step"], m["t"] - t0)
  ev = _jsonl(os.path.join(wd, "hotswap_events.jsonl"))
  # a second death while recovering has no step: it is placed at the step its recovery ends on
  inj, last = [], None
  for e in ev:
    if e["event"] == "inject":
      step = e.get("step", last)
      inj.append([round(first_t.get(step, float("nan")), 3), step, e["kind"]])
      last = step if step is not None else last

  return {
      "train_wall_s": s["train_wall_s"], "failures_injected": s["failures_injected"],
      # [step, dt_s, layer on, excluded]: excluded = first step (compiles), the step after an on/off switch,
      # or a step holding a persistent save (what benchmarks/hotswap.py leaves out of its ratio)
      "step_log": [[x["step"], round(x["dt"], 6), x["on"], bool(x["first"] or x["transition"] or x["after_save"])]
                   for x in s["step_log"] if x["gen"] == 0],
      "loss": [[round(m["t"] - t0, 3), m["step"], m["loss"]] for m in met],
      "injections": inj,
      "recoveries": [{"kind": (r.get("injected") or ["uninjected"])[0], "tier": r["tier"],
                      "recovery_time_s": r["recovery_time_s"], "breakdown_s": r["breakdown_s"],
                      "restarts_during_recovery": r["restarts_during_recovery"]} for r in s["recoveries"]],
  }


def collect(quick_json: str, full_json: str, data_dir: str = DATA) -> list:
  """Copy the two benchmark JSONs and extract what the figures need from their workdirs (no checkpoints)."""
  runs = {}
  for tag, src in (("quick", quick_json), ("full", full_json)):
    with open(src) as f:
      d = json.load(f)
    d.setdefault("command", RERUN[tag].replace("--workdir W", f"--workdir {d['workdir']}"))
    with open(os.path.join(data_dir, BENCH[tag]), "w") as f:
      json.dump(d, f, indent=1)
    runs[tag] = {k: _run_records(os.path.join(d["workdir"], w)) for k, w in
                 (("A", "A_failure_free"), ("B", "B_failures"), ("C", "C_calibration"))}
  with open(os.path.join(data_dir, RUNS), "w") as f:
    json.dump(runs, f, separators=(",", ":"))
  return [os.path.join(data_dir, n) for n in (*BENCH.values(), RUNS)]


# ------------------------------------------------------------------ figures

def _blocks(step_log):
  """Median step time of each contiguous on/off block of run A (excluded steps left out)."""
  out = {True: [], False: []}
  cur, vals = None, []
  for step, dt, on, excl in step_log + [[None, None, None, True]]:
    if on != cur and cur is not None and vals:
      out[cur].append(statistics.median(vals))
      vals = []
    cur = on if on is not None else cur
    if not excl:
      vals.append(dt)
  return out


@figure("phoenix_overhead", paper=PAPER, data=[_D + BENCH["quick"], _D + BENCH["full"], _D + RUNS], rerun=COLLECT,
        paper_number=f"zero failure-free overhead ({PAPER_SRC})")
def draw_overhead(out_path: str, data_dir: str = DATA) -> dict:
  plt = _plt()
  runs = _load(RUNS, data_dir)
  fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
  summary = {}
  for ax, tag, title in zip(axes, ("quick", "full"), ("tiny model (--quick)", "3.3M-param model")):
    b = _load(BENCH[tag], data_dir)
    blk = _blocks(runs[tag]["A"]["step_log"])
    ax.boxplot([[1e3 * v for v in blk[False]], [1e3 * v for v in blk[True]]], showmeans=True)
    ax.set_xticks([1, 2], [f"layer off\n({len(blk[False])} blocks)", f"layer on\n({len(blk[True])} blocks)"])
    ax.set_ylabel("median step time per 5-step block (ms)")
    lo, hi = b["overhead_ratio_ci95"]
    r = b["failure_free_overhead_ratio"]
    ax.set_title(f"{title}: on/off = {r:.3f}\n95% CI [{lo:.2f}, {hi:.2f}], load avg {b['load_avg']:.1f}", fontsize=9)
    summary[tag] = {"ratio": round(r, 4), "ci95": [round(lo, 4), round(hi, 4)], "blocks": [len(blk[False]), len(blk[True])],
                    "load_avg": round(b["load_avg"], 1)}
  q, f_ = summary["quick"], summary["full"]
  summary["ours"] = (f"step time on/off {q['ratio']:.3f} (95% CI {q['ci95'][0]:.2f}-{q['ci95'][1]:.2f}, tiny model, "
                     f"load {q['load_avg']}); {f_['ratio']:.3f} ({f_['ci95'][0]:.2f}-{f_['ci95'][1]:.2f}, 3.3M params, "
                     f"load {f_['load_avg']})")
  fig.suptitle("PHOENIX/DeadPool: failure-free overhead of the snapshot layer (paper: zero) - 4 CPU nodes, 2 shared cores",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(out_path, dpi=120)
  plt.close(fig)
  return summary


@figure("phoenix_recovery", paper=PAPER, data=[_D + BENCH["quick"], _D + RUNS], rerun=COLLECT,
        paper_number=f"hot-swap recovery < 40 s at 512 A100s / 65B ({PAPER_SRC})")
def draw_recovery(out_path: str, data_dir: str = DATA) -> dict:
  plt = _plt()
  runs = _load(RUNS, data_dir)["quick"]
  recs = runs["C"]["recoveries"] + runs["B"]["recoveries"]
  fig, ax = plt.subplots(figsize=(8.5, 4.5))
  summary, bottoms = {}, [0.0] * len(KINDS)
  per_kind = {k: [r for r in recs if r["kind"] == k] for k in KINDS}
  for q, col in zip(PARTS, ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:gray")):
    ys = [statistics.median([r["breakdown_s"][q] for r in per_kind[k]]) if per_kind[k] else 0.0 for k in KINDS]
    ax.bar(range(len(KINDS)), ys, 0.6, bottom=bottoms, label=q.replace("_", " "), color=col)
    bottoms = [a + b for a, b in zip(bottoms, ys)]
  for i, k in enumerate(KINDS):
    tot = [r["recovery_time_s"] for r in per_kind[k]]
    if tot:
      ax.text(i, bottoms[i], f"total median {statistics.median(tot):.1f} s\nmax {max(tot):.1f} s, n={len(tot)}",
              ha="center", va="bottom", fontsize=7)
      summary[k] = {"n": len(tot), "median_total_s": round(statistics.median(tot), 3), "max_s": round(max(tot), 2),
                    **{q: round(statistics.median([r["breakdown_s"][q] for r in per_kind[k]]), 3) for q in PARTS}}
  summary["ours"] = ("median " + ", ".join(f"{v['median_total_s']:.1f} s ({k})" for k, v in summary.items()) +
                     f"; max {max(v['max_s'] for v in summary.values()):.1f} s; {len(recs)} recoveries, 4 CPU nodes")
  labels = {"recovery": "recovery\n(2nd death while\nrecovering)", "hang": "hang\n(heartbeat 2 s)"}
  ax.set_xticks(range(len(KINDS)), [labels.get(k, k) for k in KINDS], fontsize=8)
  ax.set_ylabel("seconds (median of each part)")
  ax.set_ylim(0, max(bottoms) * 1.35)
  b = _load(BENCH["quick"], data_dir)
  ax.set_title(f"Recovery breakdown per failure kind (paper: < 40 s at 512 A100s); tiny model, 4 CPU nodes,\n"
               f"runs C + B: {len(recs)} recoveries of {runs['C']['failures_injected'] + runs['B']['failures_injected']}"
               f" injections, load avg {b['load_avg']:.1f}", fontsize=9)
  ax.legend(fontsize=8, ncol=5, loc="upper center")
  fig.tight_layout()
  fig.savefig(out_path, dpi=120)
  plt.close(fig)
  return summary


@figure("phoenix_loss", paper=PAPER, data=[_D + BENCH["quick"], _D + RUNS], rerun=COLLECT,
        paper_number=f"minimal recomputation after a failure, from in-memory checkpoints ({PAPER_SRC})")
def draw_loss(out_path: str, data_dir: str = DATA) -> dict:
  plt = _plt()
  runs = _load(RUNS, data_dir)["quick"]
  b = _load(BENCH["quick"], data_dir)
  fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
  styles = {"A": ("failure-free (A)", "k", 2.5), "C": ("12 injected (C)", "tab:blue", 1.2),
            "B": ("65 injected (B)", "tab:red", 1.0)}
  summary = {}
  for tag in ("A", "C", "B"):
    r = runs[tag]
    lab, col, lw = styles[tag]
    pts = sorted(r["loss"])
    ax.plot([p[0] for p in pts], [p[2] for p in pts], color=col, lw=lw, label=lab)
    for t, step, _ in r["injections"]:
      if t == t:
        ax.axvline(t, color=col, lw=0.4, alpha=0.4)
    by_step = {}
    for _, s, v in r["loss"]:
      by_step.setdefault(s, v)
    ax2.plot(sorted(by_step), [by_step[s] for s in sorted(by_step)], color=col, lw=lw, label=lab,
             ls="-" if tag == "A" else "--")
    summary[tag] = {"wall_s": round(max(p[0] for p in pts), 1), "steps": max(by_step), "final_loss": by_step[max(by_step)],
                    "injections": len(r["injections"])}
  ident = b["trajectory_identical"]
  ax.set_xlabel("wall time since the first step (s); thin lines: injections")
  ax.set_ylabel("training loss")
  ax.set_title(f"Loss vs wall time (tiny model, load avg {b['load_avg']:.1f})", fontsize=9)
  ax.legend(fontsize=8)
  ax2.set_xlabel("step")
  ax2.set_title(f"Loss vs step: bit-identical to A (B: {ident['B']}, C: {ident['C']})", fontsize=9)
  fig.suptitle("PHOENIX/DeadPool: runs with failures over the failure-free run", fontsize=10)
  fig.tight_layout()
  fig.savefig(out_path, dpi=120)
  plt.close(fig)
  summary["trajectory_identical"] = ident
  summary["ours"] = (f"{summary['C']['injections']} and {summary['B']['injections']} injected failures: losses and final "
                     f"state bit-identical to the failure-free run (B {ident['B']}, C {ident['C']}), final loss "
                     f"{summary['A']['final_loss']:.3f}; wall {summary['A']['wall_s']:.0f} / {summary['C']['wall_s']:.0f} / "
                     f"{summary['B']['wall_s']:.0f} s")
  return summary


def _curve(costs, grid):
  from resilience import goodput
  return goodput.goodput_vs_mtbf(costs, grid)


@figure("phoenix_goodput", paper=PAPER, data=[_D + BENCH["quick"], _D + RUNS, _D + PROJ], rerun=COLLECT,
        paper_number=f"zero overhead and < 40 s recovery at 512 A100s / 65B; no goodput number in the abstract ({PAPER_SRC})")
def draw_goodput(out_path: str, data_dir: str = DATA) -> dict:
  import dataclasses
  from resilience import goodput
  plt = _plt()
  b = _load(BENCH["quick"], data_dir)
  runs = _load(RUNS, data_dir)["quick"]
  proj = _load(PROJ, data_dir)
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
  grid = [10 ** (1 + i * 0.05) for i in range(101)]  # 10 s .. 1e6 s
  host = goodput.costs_from_benchmark(b, 3600.0)
  summary = {"host": {}, "projection": {}}
  for key, lab, col in STRATS:
    a1.plot(grid, [r[f"goodput_{key}"] for r in _curve(host, grid)], color=col, label=lab)
  # run B: failures injected at a known rate; measured vs predicted goodput as points
  B = runs["B"]
  node_mtbf_b = B["train_wall_s"] / B["failures_injected"] * b["nodes"]
  a1.plot([node_mtbf_b], [b["goodput_measured"]], "k*", ms=11, label=f"run B measured ({B['failures_injected']} failures)")
  a1.plot([node_mtbf_b], [b["goodput_predicted_from_other_runs"]], "kx", ms=9, label="run B predicted from A, P, C")
  m = b["measured_costs"]
  a1.set_title(f"(a) this host: 4 CPU nodes + 1 spare, tiny model; step {1e3 * m['step_s']['value']:.0f} ms,\n"
               f"hot-swap recovery {m['hotswap_recovery_s']['value']:.1f} s, restart {m['disk_restart_s']['value']:.1f} s,"
               f" save {m['disk_save_s']['value']:.2f} s (all measured, load avg {b['load_avg']:.1f});\n"
               f"curves assume exponential failures; run B injects at steps, some during a recovery", fontsize=8)
  for x in (600.0, 3600.0, 86400.0):
    summary["host"][f"node_mtbf_{int(x)}s"] = {k: round(v, 3) for k, v in _curve(host, [x])[0].items() if k.startswith("goodput_")}
  curve_b = _curve(host, [node_mtbf_b])[0]["goodput_hotswap"]
  summary["host"]["run_B"] = {"node_mtbf_s": round(node_mtbf_b, 1), "measured": round(b["goodput_measured"], 3),
                              "predicted": round(b["goodput_predicted_from_other_runs"], 3),
                              "hotswap_curve_at_its_rate": round(curve_b, 3)}
  c = {k: v["value"] for k, v in proj["costs"].items()}
  pc = goodput.Costs(node_mtbf_s=3600.0, **c)
  grid2 = [10 ** (2 + i * 0.06) for i in range(101)]  # 100 s .. 1e8 s
  for key, lab, col in STRATS:
    a2.plot([g / 3600 for g in grid2], [r[f"goodput_{key}"] for r in _curve(pc, grid2)], color=col, label=lab)
  ours = dataclasses.replace(pc, hotswap_overhead_ratio=b["measured_costs"]["hotswap_overhead_ratio"]["value"])
  a2.plot([g / 3600 for g in grid2], [r["goodput_hotswap"] for r in _curve(ours, grid2)], color="tab:green", ls="--",
          label=f"hot swap, our measured overhead x{ours.hotswap_overhead_ratio:.2f}")
  for x in (proj["node_mtbf_mark_s"],):
    a2.axvline(x / 3600, color="gray", lw=0.8, ls=":")
    a2.text(x / 3600, 0.6, "Llama 3's observed\nnode MTBF ", ha="right", fontsize=7, color="gray")
    summary["projection"][f"node_mtbf_{int(x)}s"] = {k: round(v, 3) for k, v in _curve(pc, [x])[0].items()
                                                       if k.startswith("goodput_")}
  at10 = _curve(pc, [36000.0])[0]
  summary["projection"]["node_mtbf_36000s"] = {k: round(v, 3) for k, v in at10.items() if k.startswith("goodput_")}
  h6 = summary["host"]["node_mtbf_600s"]
  summary["ours"] = (f"host, node MTBF 600 s: hot swap {h6['goodput_hotswap']:.2f}, in-memory + restart "
                     f"{h6['goodput_in_memory_restart']:.2f}, disk {h6['goodput_disk_checkpoint_restart']:.2f}; run B "
                     f"measured {b['goodput_measured']:.3f} vs predicted {b['goodput_predicted_from_other_runs']:.3f} (schedule) and "
                     f"{curve_b:.2f} (curve); "
                     f"512 GPUs / 65B at 10 h: {at10['goodput_hotswap']:.2f} / {at10['goodput_in_memory_restart']:.2f} / "
                     f"{at10['goodput_disk_checkpoint_restart']:.2f} (restarts: lower bounds)")
  a2.set_title(f"(b) projected: {proj['scale']}; step {c['step_s']:.1f} s, hot-swap recovery {c['hotswap_recovery_s']:.0f} s,"
               f"\nsave {c['disk_save_s']:.1f} s; restarts {c['disk_restart_s']:.0f} s (disk), {c['mem_restart_s']:.0f} s (memory) are this "
               f"host's, LOWER BOUNDS at 512 GPUs\n(every cost's source: benchmarks/data/{PROJ})", fontsize=8)
  for ax, xl in ((a1, "node MTBF (s)"), (a2, "node MTBF (hours)")):
    ax.set_xscale("log")
    ax.set_xlabel(xl)
    ax.set_ylabel("goodput (useful / wall time)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
  fig.suptitle("PHOENIX/DeadPool: goodput vs mean time between failures (Daly's model, resilience/goodput.py)", fontsize=10)
  fig.tight_layout()
  fig.savefig(out_path, dpi=120)
  plt.close(fig)
  return summary


DRAW = {"phoenix_overhead": draw_overhead, "phoenix_recovery": draw_recovery, "phoenix_loss": draw_loss,
        "phoenix_goodput": draw_goodput}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--collect", nargs=2, metavar=("QUICK_JSON", "FULL_JSON"),
                  help="copy two benchmarks/hotswap.py outputs and extract their workdirs into benchmarks/data")
  ap.add_argument("--out-dir", default=None, help="write DIR/NAME.png instead of each figure's committed path")
  a = ap.parse_args(argv)
  if a.collect:
    print("\n".join(collect(*a.collect)))
  for name, fn in DRAW.items():
    out = os.path.join(a.out_dir, f"{name}.png") if a.out_dir else os.path.join(ROOT, registry.FIGURES[name].out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    print(out, fn(out)["ours"])


if __name__ == "__main__":
  main()
