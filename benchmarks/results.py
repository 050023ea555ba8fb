"""benchmarks/RESULTS.md, rendered from the data files under benchmarks/data/.

  python -m benchmarks.results            # writes benchmarks/RESULTS.md
  python -m benchmarks.results --check    # exit 1 if benchmarks/RESULTS.md is not what the data gives

One row per headline: its key figures, beside the simplest baseline on the same rows where the data has one, with
the command that produced them, the machine and the date, all read from the data file. A benchmark writes its data
file; nothing appends to RESULTS.md, and the history of every figure is the git history of its data file. A field a
data file lacks prints as "n/a"; a data file whose shape a renderer does not know prints its top-level figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "benchmarks", "data")
OUT = os.path.join(ROOT, "benchmarks", "RESULTS.md")


# ---------------------------------------------------------------------------------------------- formatting
def g(d, *path, default=None):
  """``d[p0][p1]...``, or ``default`` where any step is missing or not a container."""
  for p in path:
    try:
      d = d[p]
    except (KeyError, IndexError, TypeError):
      return default
  return d


def num(x, fmt: str = ".2f", unit: str = "") -> str:
  if isinstance(x, bool) or not isinstance(x, (int, float)):
    return "n/a" if x is None else str(x)
  return f"{x:{fmt}}{unit}"


def pct(x, fmt: str = ".2f") -> str:
  return num(x, fmt, "%")


def times(x, k: float):
  """``x * k`` for a number, else None (prints as n/a)."""
  return x * k if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def count(x):
  """The number of entries of a list or dict, or the number itself."""
  return len(x) if isinstance(x, (list, dict)) else x


def _cell(s) -> str:
  return str(s).replace("|", "\\|").replace("\n", " ")


@dataclass
class Headline:
  title: str
  files: tuple  # data files, relative to the data folder; the first one gives the provenance unless ``prov`` does
  render: Callable  # (*dicts) -> (figures, baseline)
  prov: Callable = None  # (*dicts) -> (command, machine, date)


def _prov(d: dict) -> tuple:
  return (d.get("command"), d.get("machine") or d.get("host"), d.get("date") or d.get("run_at"))


# ---------------------------------------------------------------------------------------------- renderers
def _train_step(d):
  s = d.get("single", {})
  r = s.get("framework_over_plain", {})
  fig = (f"framework step / hand-written jax.jit step **{num(r.get('median'), '.3f')}** (paired median of "
         f"{num(r.get('n'), 'd')} repetitions, {num(r.get('min'), '.3f')}-{num(r.get('max'), '.3f')}; CPU time "
         f"{num(g(s, 'framework_over_plain_cpu', 'median'), '.3f')}); {num(times(s.get('n_params'), 1e-6), '.1f')}M "
         f"params, {num(s.get('tokens_per_s'), '.0f')} tokens/s; achieved / matmul FLOP/s "
         f"{num(s.get('flops_over_matmul'), '.3f')}; loss difference {num(g(s, 'loss_check', 'max_abs_diff'), '.1e')}")
  base = (f"the hand-written jax.jit step (benchmarks/plain_llama.py) = 1.000; its achieved / matmul FLOP/s "
          f"{num(s.get('plain_flops_over_matmul'), '.3f')}")
  return fig, base


def _host_sets(sets, floor):
  runs = sets.get("runs", [])
  med = lambda k: statistics.median([r[k] for r in runs if isinstance(r.get(k), (int, float))] or [float("nan")])
  each = lambda k, f: " / ".join(num(r.get(k), f) for r in runs)
  fig = (f"{len(runs)} sets of {num(g(runs, 0, 'n_configs'), 'd')} training configs: training-step MAPE "
         f"**{pct(med('mape'))}** (median; {each('mape', '.2f')}), decode TPOT MAPE **{pct(med('tpot_mape'))}** "
         f"({each('tpot_mape', '.2f')}), Kendall tau {num(med('kendall_tau'), '.3f')}, peak memory max error vs "
         f"memory_analysis {pct(med('peak_memory_max_err_pct_vs_memory_analysis'), '.1f')}")
  sb = floor.get("same_boot") or {}
  base = (f"a perfect model, scored by one set against another (same configs, `{os.path.basename(FLOOR)}`): "
          f"training {pct(sb.get('train_mape'))}, TPOT {pct(sb.get('tpot_mape'))}, Kendall tau "
          f"{num(sb.get('train_tau'), '.3f')} ({num(sb.get('ordered_pairs'), 'd')} ordered pairs)")
  return fig, base


def _host_sets_prov(sets, floor):
  runs = sets.get("runs", [])
  dates = sorted(r.get("date") for r in runs if r.get("date"))
  cmds = sorted({r.get("command") for r in runs if r.get("command")})
  cmd = " ; ".join(f"{c} (x{sum(r.get('command') == c for r in runs)})" for c in cmds)
  machines = sorted({r.get("machine") for r in runs if r.get("machine")})
  return (f"{cmd}; floor: {floor.get('command', 'n/a')}" if cmds else None, ", ".join(machines) or None,
          f"{dates[0]} to {dates[-1]}" if dates else None)


def _host_one(d):
  floor = g(d, "host_floor", "train_mape")
  fig = (f"{num(d.get('n_configs'), 'd')} training configs, {num(d.get('rounds'), 'd')} round(s): training-step MAPE "
         f"**{pct(d.get('mape'))}**, decode TPOT MAPE {pct(d.get('tpot_mape'))} "
         f"({num(d.get('tpot_n_configs'), 'd')} configs), Kendall tau {num(d.get('kendall_tau'), '.3f')}, top-1 regret "
         f"{pct(d.get('top1_regret_pct'), '.1f')}, peak memory max error vs memory_analysis "
         f"{pct(d.get('peak_memory_max_err_pct_vs_memory_analysis'), '.1f')}; backend "
         f"{d.get('backend_resolved', 'n/a')}, load {num(d.get('load_avg'), '.1f')}")
  if floor is not None:
    base = f"a perfect model on the same rounds (each predicted by the others' median): training {pct(floor)}"
  else:
    base = (f"none on these rows (one round); measurement noise p10-p90 {pct(d.get('noise_pct'))} (training), "
            f"{pct(d.get('tpot_noise_pct'))} (TPOT)")
  return fig, base


def _published(d):
  sc = d.get("scores") or {}
  parts, bases = [], []
  for k in ("included", "design", "heldout", "fp16", "fits_chip_diagnosis"):
    s = sc.get(k)
    if not isinstance(s, dict):
      continue
    m, b = s.get("model") or {}, s.get("baseline") or {}
    strong = "**" if k == "included" else ""
    parts.append(f"{k} ({num(s.get('n'), 'd')} rows): MAPE {strong}{pct(m.get('mape_pct'), '.1f')}{strong}, tau "
                 f"{num(m.get('tau_global'), '.2f')} global / {num(m.get('tau_tables'), '.2f')} within tables")
    bases.append(f"{k}: MAPE {pct(b.get('mape_pct'), '.1f')}, tau {num(b.get('tau_global'), '.2f')} / "
                 f"{num(b.get('tau_tables'), '.2f')}")
  for k in sorted(set(sc) - {"included", "design", "heldout", "fp16", "fits_chip_diagnosis"}):
    parts.append(f"{k}: {json.dumps(sc[k], sort_keys=True)[:200]}")
  chips = g(sc, "included", "model", "by_chip") or {}
  bchips = g(sc, "included", "baseline", "by_chip") or {}
  if chips:
    parts.append("by chip (included) " + ", ".join(
        f"{c} {pct(g(v, 'mape_pct'), '.1f')} vs {pct(g(bchips, c, 'mape_pct'), '.1f')}"
        for c, v in sorted(chips.items())))
  fits = d.get("fits")
  if isinstance(fits, dict):
    parts.append(f"programs that fit their chip {num(fits.get('n_fit'), 'd')} of {num(fits.get('n_checked'), 'd')}")
  parts.append(f"priced {num(d.get('n_priced'), 'd')}, not compiled {num(d.get('n_not_compiled'), 'd')}, failed "
               f"{num(d.get('n_failed'), 'd')}, stale {num(count(d.get('stale')), 'd')}")
  base_name = g(d, "baseline", "name") or g(d, "baseline", "what") or (
      d["baseline"] if isinstance(d.get("baseline"), str) else "the constant-MFU baseline")
  return "; ".join(parts), f"{base_name}, same rows: " + "; ".join(bases)


def _emulate_validate(d):
  lays = d.get("layouts") or {}
  per = "; ".join(f"{k}: real {num(1e3 * v['real_s'], '.1f')} ms, emulated {num(1e3 * v['emulated_s'], '.1f')} ms "
                  f"({num(v.get('error_pct'), '+.1f')}%), peak memory diff {num(v.get('memory_error_bytes'), 'd')} B"
                  for k, v in lays.items())
  fig = (f"mean |iteration-time error| over {len(lays)} layouts **{pct(d.get('mean_abs_error_pct'))}** "
         f"(target {pct(d.get('target_pct'), '.0f')}; median of per-round pairs "
         f"{pct(d.get('mean_abs_paired_error_pct'))}), {num(d.get('rounds'), 'd')} rounds, "
         f"{num(d.get('processes'), 'd')} processes over gloo; {per}")
  roof = [abs(v["roofline_error_pct"]) for v in lays.values() if isinstance(v.get("roofline_error_pct"), (int, float))]
  drift = [abs(x) for v in lays.values() for x in (v.get("real_drift_across_emulation_pct") or [])]
  base = (f"the roofline on the same layouts: mean |error| {pct(statistics.mean(roof)) if roof else 'n/a'}; the "
          f"real job itself moves {pct(statistics.median(drift)) if drift else 'n/a'} (median) between the runs "
          f"just before and after each emulation")
  return fig, base


def _emulate_scale(d):
  ranks = "; ".join(f"{r.get('class')} rank {r.get('rank')}: compute {num(r.get('compute_s'))} s, exposed comm "
                    f"{num(r.get('exposed_comm_s'))} s, pipeline wait {num(r.get('wait_s'))} s"
                    for r in d.get("per_rank") or [])
  mesh = " x ".join(f"{k} {v}" for k, v in (d.get("mesh") or {}).items() if v != 1)
  fig = (f"{num(d.get('emulated_devices'), 'd')} ranks ({mesh}), {d.get('config')}, reduced: "
         f"{d.get('reduced', 'n/a')}, executed: {d.get('executed')}, target {d.get('hardware')}"
         f"{', overrides ' + ' '.join(d['overrides']) if d.get('overrides') else ''}: iteration "
         f"**{num(d.get('iteration_time_s'))} s**, MFU {pct(times(d.get('mfu'), 100), '.1f')}; {ranks}; per-chip peak "
         f"{num(d.get('peak_memory_bytes'), ',d')} B; wall {num(d.get('process_wall_s'), '.0f')} s, peak RSS "
         f"{num(times(d.get('peak_rss_bytes'), 1e-9), '.2f')} GB")
  p = d.get("predict") or {}
  base = (f"`perfmodel predict` on the same config: {num(p.get('step_time_s'))} s "
          f"({pct(times(p.get('relative_difference'), 100), '+.2f')})")
  return fig, base


def _emulate_ranks(d):
  pts = d.get("points") or []
  fig = "emulator cost from one CPU device: " + "; ".join(
      f"{p.get('emulated_ranks')} ranks: wall {num(p.get('process_wall_s'), '.1f')} s, peak RSS "
      f"{num(times(p.get('peak_rss_bytes'), 1e-9), '.2f')} GB" for p in pts)
  return f"{fig} ({d.get('config')}, target {d.get('hardware')})", "-"


def _hotswap(full, quick):
  def one(d, name):
    ci = d.get("overhead_ratio_ci95") or [None, None]
    return (f"{name}: **{num(d.get('failures_survived'), 'd')} of {num(d.get('failures_injected'), 'd')}** failures "
            f"survived (tiers {', '.join(d.get('tiers') or [])}), recovery {num(d.get('recovery_time_s'), '.1f')} s "
            f"median (max {num(d.get('recovery_time_s_max'), '.1f')} s), trajectory identical "
            f"{json.dumps(d.get('trajectory_identical'), sort_keys=True)}, failure-free overhead ratio "
            f"{num(d.get('failure_free_overhead_ratio'), '.3f')} (95% CI {num(ci[0], '.2f')}-{num(ci[1], '.2f')}), "
            f"load {num(d.get('load_avg'), '.1f')}")
  fig = one(full, "full model") + "; " + one(quick, "tiny model")
  base = "; ".join(f"{n}: goodput measured {num(d.get('goodput_measured'), '.3f')} vs predicted from the other runs "
                   f"{num(d.get('goodput_predicted_from_other_runs'), '.3f')}" for n, d in
                   (("full model", full), ("tiny model", quick)))
  return fig, base


def _hotswap_prov(full, quick):
  return tuple(" ; ".join(str(x) for x in dict.fromkeys(p) if x) or None for p in zip(_prov(full), _prov(quick)))


def _ondevice_single(d):
  r = d.get("result") or {}
  figs, bases = [], []
  for k in sorted(x for x in r if x.startswith("threads_")):
    t = r[k]
    figs.append(f"{k.replace('_', ' ')}: ours {num(g(t, 'ours', 'tpot_ms'))} ms/token, "
                f"**{num(t.get('ratio_ours_over_llama_cpp_exact'), '.2f')}x** of llama.cpp's time in the same "
                f"configuration ({num(t.get('ratio_ours_over_llama_cpp_default'), '.2f')}x of its default), same "
                f"greedy tokens {t.get('same_greedy_tokens_exact_config')}")
    bases.append(f"{k.replace('_', ' ')}: llama.cpp {num(g(t, 'llama_cpp_exact', 'tpot_ms'))} ms/token "
                 f"({g(t, 'llama_cpp_exact', 'config', default='n/a')}), default "
                 f"{num(g(t, 'llama_cpp_default', 'tpot_ms'))} ms/token")
  fig = f"{r.get('model', 'n/a')}, {num(r.get('rounds'), 'd')} rounds: " + "; ".join(figs)
  return fig, f"llama.cpp {g(r, 'llama_cpp_build', 'version', default='n/a')} on the same file: " + "; ".join(bases)


def _ring(ring: dict) -> tuple:
  best = ring.get("best_single_device")
  fig = (f"Halda ring {num(g(ring, 'halda_ring', 'tpot_ms'), '.1f')} ms/token (k={g(ring, 'halda_ring', 'k')}), "
         f"**{num(ring.get('speedup_vs_best_single_device'), '.2f')}x** the best single device; exo-like split "
         f"{num(g(ring, 'exo_like_memory_split', 'tpot_ms'), '.1f')} ms, dllama-like "
         f"{num(g(ring, 'dllama_like_tensor_parallel', 'tpot_ms'), '.1f')} ms ({ring.get('clock')} clock)")
  base = f"the best single device ({best}) alone: {num(g(ring, f'alone_{best}', 'tpot_ms'), '.1f')} ms/token"
  return fig, base


def _ondevice_ring(d):
  r = d.get("result") or {}
  fig, base = _ring(r.get("ring") or {})
  return f"{r.get('model', 'n/a')}: {fig}", base


def _ondevice_sizes(d):
  figs, bases = [], []
  for run in d.get("runs") or []:
    f, b = _ring(run.get("ring") or {})
    figs.append(f"{run.get('model')}: {f}")
    bases.append(f"{run.get('model')}: {b}")
  return "; ".join(figs), "; ".join(bases)


def _ondevice_ksweep(d):
  rows = d.get("rows") or []
  fig = f"{d.get('model', 'n/a')}: TPOT by ring rounds k: " + ", ".join(
      f"{r.get('runtime')} k={r.get('k')} {num(r.get('tpot_ms'), '.1f')} ms" for r in rows)
  k1 = [r for r in rows if r.get("k") == 1]
  return fig, "k = 1 (no ring rounds): " + ", ".join(
      f"{r.get('runtime')} {num(r.get('tpot_ms'), '.1f')} ms" for r in k1)


def _ondevice_spec(d):
  figs, bases = [], []
  for run in d.get("runs") or []:
    s = g(run, "result", "spec") or {}
    gam = sorted((k for k in s if k.startswith("gamma")), key=lambda k: int(k[5:]) if k[5:].isdigit() else 0)
    figs.append(f"{run.get('label', g(run, 'result', 'model'))}: " + ", ".join(
        f"{k} {num(g(s, k, 'speedup'), '.2f')}x (acceptance {num(g(s, k, 'acceptance'), '.2f')}, identical "
        f"{g(s, k, 'identical_to_greedy')})" for k in gam))
    bases.append(f"greedy {num(s.get('greedy_tokens_per_s'), '.0f')} tokens/s")
  return "speculative decoding, speed-up over greedy: " + "; ".join(figs), "greedy decoding: " + "; ".join(bases)


def _ondevice_spec_prov(d):
  runs = d.get("runs") or []
  cmds = list(dict.fromkeys(r.get("command") for r in runs if r.get("command")))
  dates = sorted(r.get("date") for r in runs if r.get("date"))
  return (" ; ".join(cmds) or None, d.get("machine"), f"{dates[0]} to {dates[-1]}" if dates else None)


def _ondevice_moe(d):
  r = d.get("result") or {}
  m = r.get("moe") or {}
  o, l = m.get("ours") or {}, m.get("llama_cpp") or {}
  fig = (f"{r.get('model', 'n/a')}, cap {m.get('cap_kind', 'n/a')}: ours {num(o.get('tpot_ms'), '.1f')} ms/token, "
         f"{num(o.get('pages_read_per_token'), '.0f')} pages read/token (routed experts "
         f"{num(o.get('routed_expert_mb_per_token'), '.2f')} MB/token of {num(o.get('all_expert_mb'), '.1f')} MB), "
         f"same greedy tokens {m.get('same_greedy_tokens')}" + (f"; ours: {o['error']}" if "error" in o else ""))
  base = (f"llama.cpp on the same file and cap: {num(l.get('tpot_ms'), '.1f')} ms/token, "
          f"{num(l.get('pages_read_per_token'), '.0f')} pages read/token" + (f"; {l['error']}" if "error" in l else ""))
  return fig, base


def _reliability(d):
  def counts(x):
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in x.items() if isinstance(v, (int, float, str)))
  fig = f"all areas: {counts(d.get('total') or {})}"
  for name, a in sorted((d.get("areas") or {}).items()):
    if isinstance(a, dict):
      fig += f"; {name}: {counts(a)}"
  return fig, "-"


def _infer_search(d):
  fig = (f"{num(d.get('n_candidates'), 'd')} candidates: predicted best {d.get('best_predicted')}, speed-up over the "
         f"default **{pct(d.get('measured_speedup_pct'), '+.1f')} measured** vs "
         f"{pct(d.get('predicted_speedup_pct'), '+.1f')} predicted; measured best {d.get('best_measured', 'n/a')}")
  return fig, f"the default configuration ({d.get('default')})"


FLOOR = "perfmodel_floor.json"
HEADLINES = [
    Headline("Training step overhead (framework/, parallelism/)", ("train_step.json",), _train_step),
    Headline("Performance model, host validation: three sets", ("perfmodel_validate_sets.json", FLOOR), _host_sets,
             _host_sets_prov),
    Headline("Performance model, host validation: committed run (figures)", ("perfmodel_validate.json",), _host_one),
    Headline("Performance model vs published training runs", ("published_validation.json",), _published),
    Headline("Performance model vs published mixture-of-experts training runs", ("published_moe_validation.json",),
             _published),
    Headline("Inference-configuration search", ("infer_search.json",), _infer_search),
    Headline("Faithful emulation vs real runs", ("emulate_validate.json",), _emulate_validate),
    Headline("Emulation at scale: Llama-3-70B", ("emulate_l70b.json",), _emulate_scale),
    Headline("Emulation at scale: Llama-3-70B in the Llama 3 paper's 8192-GPU layout",
             ("emulate_l70b_paper_layout.json",), _emulate_scale),
    Headline("Emulation at scale: emulator cost vs ranks", ("emulate_ranks.json",), _emulate_ranks),
    Headline("Hot-swap resilience", ("hotswap_full.json", "hotswap_quick.json"), _hotswap, _hotswap_prov),
    Headline("On-device, single device vs llama.cpp", ("ondevice_bench_single.json",), _ondevice_single),
    Headline("On-device, emulated 4-device ring", ("ondevice_ring.json",), _ondevice_ring),
    Headline("On-device, ring across model sizes", ("ondevice_latency.json",), _ondevice_sizes),
    Headline("On-device, ring rounds k", ("ondevice_ksweep.json",), _ondevice_ksweep),
    Headline("On-device, speculative decoding", ("ondevice_spec.json",), _ondevice_spec, _ondevice_spec_prov),
    Headline("On-device, MoE under a memory cap vs llama.cpp", ("ondevice_bench_moe.json",), _ondevice_moe),
    Headline("Failing loudly (reliability campaign)", ("reliability.json",), _reliability),
]


def _generic(d) -> tuple:
  """The top-level figures of a data file whose shape the renderer does not know."""
  items = [f"{k} {json.dumps(v, sort_keys=True) if not isinstance(v, float) else num(v, '.4g')}"
           for k, v in (d.items() if isinstance(d, dict) else []) if isinstance(v, (int, float, str, bool))
           and k not in ("command", "machine", "date", "run_at", "host")]
  return "; ".join(items[:16]) or "n/a", "-"


# ---------------------------------------------------------------------------------------------- the document
def render(data_dir: str = DATA) -> str:
  rows = []
  for h in HEADLINES:
    paths = [os.path.join(data_dir, f) for f in h.files]
    if not os.path.exists(paths[0]):
      continue
    ds = []
    for p in paths:
      try:
        with open(p) as f:
          ds.append(json.load(f))
      except (OSError, ValueError):
        ds.append({})
    try:
      fig, base = h.render(*ds)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, AttributeError):
      fig, base = _generic(ds[0])
    try:
      cmd, machine, date = (h.prov or (lambda d, *_: _prov(d)))(*ds)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
      cmd, machine, date = None, None, None
    data = ", ".join(f"[`{f}`](data/{f})" for f, p in zip(h.files, paths) if os.path.exists(p))
    rows.append(f"| {_cell(h.title)} | {_cell(fig)} | {_cell(base)} | {_cell(f'`{cmd}`' if cmd else 'n/a')} | "
                f"{_cell(machine or 'n/a')} | {_cell(date or 'n/a')} | {data} |")
  head = ("# Benchmark results\n\n"
          "Written by `python -m benchmarks.results` from the data files under `benchmarks/data/`; do not edit by "
          "hand (`python -m benchmarks.results --check` fails when this file and the data disagree). One row per "
          "headline: the current figures, the simplest baseline on the same rows where the data has one, and the "
          "command, machine and date recorded in the data file. Earlier values are in the git history of each data "
          "file.\n\n"
          "| headline | result | baseline (same rows) | command | machine | date | data |\n"
          "|---|---|---|---|---|---|---|\n")
  return head + "\n".join(rows) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.results", description=__doc__.split("\n\n")[0])
  ap.add_argument("--check", action="store_true", help="exit 1 if the file differs from what the data gives")
  ap.add_argument("--data", default=DATA, help="folder of the data files (default: benchmarks/data)")
  ap.add_argument("--out", default=OUT, help="the rendered file (default: benchmarks/RESULTS.md)")
  a = ap.parse_args(argv)
  text = render(a.data)
  if a.check:
    try:
      with open(a.out) as f:
        same = f.read() == text
    except OSError:
      same = False
    if not same:
      print(f"{os.path.relpath(a.out, ROOT)} differs from what {os.path.relpath(a.data, ROOT)} gives: run "
            f"`python -m benchmarks.results`", file=sys.stderr)
      return 1
    return 0
  with open(a.out, "w") as f:
    f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
