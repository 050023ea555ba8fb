"""PrismLLM (arXiv 2605.15617, emulation) figures, drawn from committed data under benchmarks/data/.

- prismllm_iteration_time: emulated vs real 2-rank iteration time per layout, the error beside the host's floor
- prismllm_memory: per-rank peak memory of the emulated program vs the real compiled program, per layout
- prismllm_scale: emulator wall time and host peak memory vs emulated ranks (8 -> 8192) from one CPU device
- prismllm_l70b_stages: Llama-3-70B x 8192 ranks, compute / communication / bubble per pipeline-stage class
"""
import json
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.figures.registry import data_path, figure  # noqa: E402

VALIDATE = "benchmarks/data/emulate_validate.json"
RANKS = "benchmarks/data/emulate_ranks.json"
L70B = "benchmarks/data/emulate_l70b.json"
VALIDATE_CMD = "python -m benchmarks.emulate_validate --rounds 2 --replay --no-alone"


def _load(rel):
  with open(data_path(rel)) as f:
    return json.load(f)


def _real_steps(d, layout):
  """Every measured real step time (s) of a layout, pooled over the rounds."""
  out = []
  for r in d.get("raw_rounds", []):
    real = r["layouts"].get(layout, {}).get("real")
    if real:
      out += real["step_times_s"]
  return out


@figure("prismllm_iteration_time", paper="PrismLLM", data=[VALIDATE], rerun=VALIDATE_CMD,
        paper_number="0.58% iteration-time error (8192 GPUs, real cluster)")
def draw_iteration_time(out):
  d = _load(VALIDATE)
  lays = list(d["layouts"])
  fig, (a, b) = plt.subplots(1, 2, figsize=(12, 5.2))
  x = range(len(lays))
  real = [d["layouts"][l]["real_s"] * 1e3 for l in lays]
  emu = [d["layouts"][l]["emulated_s"] * 1e3 for l in lays]
  lo, hi = [], []
  for l, r in zip(lays, real):
    s = sorted(t * 1e3 for t in _real_steps(d, l)) or [r]
    lo.append(r - s[int(0.1 * (len(s) - 1))])
    hi.append(s[int(0.9 * (len(s) - 1))] - r)
  a.bar([i - 0.2 for i in x], real, 0.4, yerr=[lo, hi], capsize=4, color="0.3",
        label="real 2-process run (p10-p90 of steps)")
  a.bar([i + 0.2 for i in x], emu, 0.4, color="tab:blue", label="emulated (1 real rank + virtual peer)")
  a.set_xticks(list(x), lays)
  a.set_xlabel("layout (2 ranks, gloo on localhost)")
  a.set_ylabel("iteration time (ms)")
  a.set_title(f"{d['rounds']} interleaved rounds, {d['date']}, {d['machine']}")
  a.legend(fontsize=8, loc="lower right")
  err = [d["layouts"][l]["error_pct"] for l in lays]
  floor = [statistics.median(abs(v) for v in d["layouts"][l]["real_drift_across_emulation_pct"]) for l in lays]
  b.bar([i - 0.2 for i in x], err, 0.4, color="tab:blue", alpha=0.7, label="emulated / real - 1")
  for i, l in enumerate(lays):
    pe = d["layouts"][l]["paired_error_pct"]
    b.scatter([i - 0.2] * len(pe), pe, color="k", s=10, zorder=3, label="per round" if i == 0 else None)
  b.bar([i + 0.2 for i in x], floor, 0.4, color="tab:red", alpha=0.5,
        label="host floor: real run's own drift\naround each emulation (median |%|)")
  b.axhline(0, color="k", lw=0.8)
  b.axhspan(-2, 2, color="tab:green", alpha=0.12, label="target |error| <= 2%")
  b.set_xticks(list(x), lays)
  b.set_ylabel("iteration-time error (%)")
  mean_floor = statistics.median(abs(v) for l in lays for v in d["layouts"][l]["real_drift_across_emulation_pct"])
  b.set_title(f"mean |error| {d['mean_abs_error_pct']:.2f}% vs host floor {mean_floor:.2f}% (paper: 0.58%)")
  b.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return {"ours": f"mean |error| {d['mean_abs_error_pct']:.2f}% on 2 CPU ranks "
                  f"({', '.join(f'{l} {e:+.1f}%' for l, e in zip(lays, err))}); host floor {mean_floor:.1f}%"}


@figure("prismllm_memory", paper="PrismLLM", data=[VALIDATE], rerun=VALIDATE_CMD,
        paper_number="<0.01% peak-memory error")
def draw_memory(out):
  d = _load(VALIDATE)
  lays = list(d["layouts"])
  real = [max(d["layouts"][l]["memory_real_per_rank_bytes"]) / 2**20 for l in lays]
  exact = [d["layouts"][l]["memory_emulated_exact_bytes"] / 2**20 for l in lays]
  standin = [d["layouts"][l]["memory_standin_program_bytes"] / 2**20 for l in lays]
  fig, ax = plt.subplots(figsize=(8, 4.6))
  x = range(len(lays))
  w = 0.27
  ax.bar([i - w for i in x], real, w, color="0.3", label="real compiled program (max over ranks)")
  ax.bar(list(x), exact, w, color="tab:blue",
         label="emulator --exact-memory: N-device program\ncompiled on N virtual CPU devices")
  ax.bar([i + w for i in x], standin, w, color="tab:orange",
         label="emulator: per-rank program with stand-in\ncollectives (the route used at 8192 ranks)")
  for i, l in enumerate(lays):
    e = d["layouts"][l]
    ax.text(i, exact[i] * 1.02, f"{e['memory_error_bytes']:+d} B", ha="center", fontsize=8, color="tab:blue")
    ax.text(i + w, standin[i] * 1.02, f"{e['memory_standin_error_pct']:+.2f}%", ha="center", fontsize=8,
            color="tab:orange")
  ax.set_xticks(list(x), lays)
  ax.set_xlabel("layout (2 ranks)")
  ax.set_ylabel("per-rank peak memory (MiB)")
  ax.set_ylim(0, max(real + exact + standin) * 1.6)
  worst = max(abs(d["layouts"][l]["memory_error_bytes"]) for l in lays)
  ax.set_title(f"per-rank peak memory; labels: error vs the real run (--exact-memory max |error| {worst} B)",
               fontsize=10)
  ax.legend(fontsize=8, loc="upper center", ncol=2)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  si = max(abs(d["layouts"][l]["memory_standin_error_pct"]) for l in lays)
  return {"ours": f"--exact-memory: max |error| {worst} B on {len(lays)} layouts; per-rank stand-in program "
                  f"up to {si:.1f}%"}


@figure("prismllm_scale", paper="PrismLLM", data=[RANKS],
        rerun="python -m benchmarks.emulate_ranks --ranks 8,64,512,2048,8192",
        paper_number="8192 GPUs emulated with <1% of them")
def draw_scale(out):
  d = _load(RANKS)
  pts = sorted(d["points"], key=lambda p: p["emulated_ranks"])
  n = [p["emulated_ranks"] for p in pts]
  fig, (a, b) = plt.subplots(1, 2, figsize=(12.5, 4.8))
  top = max(p["process_wall_s"] for p in pts)
  a.plot(n, [p["process_wall_s"] for p in pts], "o-", color="tab:blue", label="wall time")
  if all("process_cpu_s" in p for p in pts):
    a.plot(n, [p["process_cpu_s"] for p in pts], "o:", color="tab:cyan", label="CPU time (user + system)")
  a.set_xscale("log", base=2)
  a.set_xlabel("emulated ranks (from 1 real CPU device)")
  a.set_ylabel("emulator time per run (s)", color="tab:blue")
  a.set_ylim(0, top * 1.3)
  a2 = a.twinx()
  a2.plot(n, [p["peak_rss_bytes"] / 1e9 for p in pts], "s--", color="tab:red", label="host peak RSS")
  a2.set_ylabel("host peak memory, RSS (GB)", color="tab:red")
  a2.set_ylim(0, max(p["peak_rss_bytes"] / 1e9 for p in pts) * 1.8)
  h1, l1 = a.get_legend_handles_labels()
  h2, l2 = a2.get_legend_handles_labels()
  a.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")
  a.set_title("cost of emulating (x labels: real / emulated devices, 1-min load on 2 cores)", fontsize=10)
  b.plot(n, [p["iteration_time_s"] * 1e3 for p in pts], "o-", color="k", label="iteration (slowest rank)")
  r0 = [p["per_rank"][0] for p in pts]
  b.plot(n, [r["compute_s"] * 1e3 for r in r0], "^--", color="tab:blue", label="rank 0 compute")
  b.plot(n, [r["comm_s"] * 1e3 for r in r0], "v--", color="tab:orange", label="rank 0 communication")
  b.plot(n, [r["wait_s"] * 1e3 for r in r0], "x:", color="0.5", label="rank 0 wait (pipeline, stragglers)")
  b.set_xscale("log", base=2)
  b.set_ylim(0, None)
  b.set_xlabel("emulated ranks")
  b.set_ylabel(f"emulated time per iteration (ms)\ncompute measured on this CPU, collectives on {d['hardware']} links",
               fontsize=9)
  b.set_title("toy Llama (4 layers, d=64): data N/8 x fsdp 2 x tensor 2 x pipeline 2", fontsize=9)
  b.legend(fontsize=7)
  a.set_xticks(n, [f"{p['emulated_ranks']}\n{100 * p['real_devices'] / p['emulated_ranks']:.3g}% real\n"
                   f"load {max(p['load_avg_1m']):.1f}" for p in pts], fontsize=8)
  b.set_xticks(n, [str(v) for v in n])
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  big = pts[-1]
  return {"ours": f"{big['emulated_ranks']} ranks from {big['real_devices']} CPU device "
                  f"({100 * big['real_devices'] / big['emulated_ranks']:.3g}%): wall {big['process_wall_s']:.0f} s "
                  f"(CPU {big.get('process_cpu_s', float('nan')):.0f} s), "
                  f"peak RSS {big['peak_rss_bytes'] / 1e9:.2f} GB (vs {pts[0]['process_wall_s']:.0f} s, "
                  f"{pts[0]['peak_rss_bytes'] / 1e9:.2f} GB at {pts[0]['emulated_ranks']})"}


@figure("prismllm_l70b_stages", paper="PrismLLM", data=[L70B],
        rerun=f"python -m benchmarks.emulate_scale --hardware h100 --json {L70B}",
        paper_number="8192-GPU emulation case (no single number)")
def draw_l70b_stages(out):
  d = _load(L70B)
  rows = d["per_rank"]
  pp = d["mesh"].get("pipeline", 1)
  names = {"pipeline:first": "stage 0\n(first)", "pipeline:middle": f"stages 1-{pp - 2}\n(middle, one class)",
           "pipeline:last": f"stage {pp - 1}\n(last)"}
  labels = [f"{names.get(r['class'], r['class'])}\nrank {r['rank']}, {r['class_size']} ranks" for r in rows]
  comp = [r["compute_s"] for r in rows]
  comm = [r.get("exposed_comm_s", r["comm_s"]) for r in rows]  # what the step waits for (overlapped: less)
  wait = [r["wait_s"] for r in rows]
  fig, ax = plt.subplots(figsize=(9, 4.8))
  x = range(len(rows))
  ax.bar(x, comp, 0.55, color="tab:blue", label=f"compute (target-compiled program, {d['hardware']} profile)")
  ax.bar(x, comm, 0.55, bottom=comp, color="tab:orange", label="exposed communication")
  ax.bar(x, wait, 0.55, bottom=[c + m for c, m in zip(comp, comm)], color="0.75", label="bubble / wait")
  for i, r in enumerate(rows):
    tot = comp[i] + comm[i] + wait[i]
    ax.text(i, tot * 1.01, f"{r['iteration_time_s']:.1f} s\nbubble {100 * wait[i] / tot:.0f}%", ha="center",
            fontsize=8)
  ax.set_xticks(list(x), labels, fontsize=8)
  ax.set_ylabel("time per iteration (s)")
  ax.set_ylim(0, max(c + m + w for c, m, w in zip(comp, comm, wait)) * 1.35)
  mesh = " x ".join(f"{k} {v}" for k, v in d["mesh"].items() if v > 1)
  ax.set_title(f"Llama-3-70B, {d['emulated_devices']} ranks ({mesh}), compile only on the {d['hardware']} target",
               fontsize=9)
  ax.legend(fontsize=8, loc="upper center", ncol=3)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  shares = [100 * w / (c + m + w) for c, m, w in zip(comp, comm, wait)]
  return {"ours": f"iteration {d['iteration_time_s']:.1f} s on {d['hardware']} (target compile, predict's chain); bubble "
                  f"{min(shares):.0f}-{max(shares):.0f}% per stage class; wall {d['process_wall_s']:.0f} s, "
                  f"peak RSS {d['peak_rss_bytes'] / 1e9:.1f} GB"}
