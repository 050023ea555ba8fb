"""Goodput under failures: disk checkpoint/restart vs in-memory + restart vs hot swap.

Model (exponential failures, rate lam = 1 / job MTBF; job MTBF = node MTBF / nodes): a segment of
``w`` seconds of work that is lost and redone whenever a failure strikes it, with a restart cost
``R`` during which failures can also strike, takes in expectation (Daly 2006, eq. for restart
cost R)::

    E[w] = exp(lam * R) * (exp(lam * w) - 1) / lam

A strategy commits work in segments: disk checkpointing every ``tau`` seconds with a blocking save
cost ``delta`` (segment tau + delta, useful tau); in-memory snapshots and hot swap commit every
step (segment = one step with the layer's overhead ratio, useful = one plain step). Goodput is
useful time / expected wall time. Hot swap and in-memory differ in R: hot swap replaces a node
(measured recovery: seconds), in-memory + restart relaunches the job (scheduler, process start,
jax init, compile) but restores from memory. Spares are idle hardware: ``goodput_per_node`` divides
by (nodes + spares) / nodes.

Where the numbers come from: ``costs_from_benchmark`` reads ``measured_costs`` of benchmarks/hotswap.py, every
one measured on the same job and labelled with its run (``Costs.sources``): step time and overhead ratios
(failure-free runs A, P), recovery time (calibration run C), save cost (P), restart cost (a relaunch after
the controller was killed, R, plus C's detection time). ``goodput_vs_mtbf`` evaluates the three strategies
over node MTBFs (the PHOENIX-style figure). ``predict_schedule`` predicts a run with a known list of injected
failures from such costs, and the benchmark compares it with that run's measured goodput: the costs never
come from the run being predicted.

Floor-3 rule: this module takes numbers (a dict or the benchmark's JSON), never imports perfmodel;
perfmodel may import nothing from here either and can read ``predict`` outputs as JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from typing import Dict, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Costs:
  step_s: float  # failure-free step time without any resilience layer
  nodes: int
  node_mtbf_s: float  # mean time between failures of one node
  spares: int = 1
  # disk checkpoint / restart
  disk_save_s: float = 30.0  # blocking part of a checkpoint save
  disk_restart_s: float = 300.0  # job relaunch + jax init + compile + read checkpoint
  disk_interval_s: Optional[float] = None  # None -> Young/Daly optimum sqrt(2 * save * MTBF)
  # in-memory snapshot + job restart
  mem_overhead_ratio: float = 1.0
  mem_restart_s: float = 120.0  # relaunch + init + compile, state from host memory
  # hot swap (measured by benchmarks/hotswap.py)
  hotswap_overhead_ratio: float = 1.0
  hotswap_recovery_s: float = 10.0
  sources: tuple = ()  # (field, where its number comes from) pairs; a field not listed is this default


def expected_segment_s(w: float, restart_s: float, lam: float, fail_during_restart: bool = True) -> float:
  """Expected wall time to finish w seconds of work that is redone after every failure.

  fail_during_restart=True: failures strike at rate lam at any time, restarts included (Daly).
  False: failures strike only while working (rate lam per working second), as when a benchmark
  injects them at steps: the number of failures before w completes is geometric with mean
  e^{lam w} - 1, each costing the time worked so far plus R.
  """
  if lam <= 0:
    return w
  if fail_during_restart:
    return math.exp(lam * restart_s) * math.expm1(lam * w) / lam
  return math.expm1(lam * w) * (1.0 / lam + restart_s)


def predict(c: Costs) -> dict:
  lam = c.nodes / c.node_mtbf_s
  job_mtbf = 1.0 / lam
  tau = c.disk_interval_s or math.sqrt(2 * c.disk_save_s * job_mtbf)
  disk = tau / expected_segment_s(tau + c.disk_save_s, c.disk_restart_s, lam)
  mem = c.step_s / expected_segment_s(c.step_s * c.mem_overhead_ratio, c.mem_restart_s, lam)
  hs = c.step_s / expected_segment_s(c.step_s * c.hotswap_overhead_ratio, c.hotswap_recovery_s, lam)
  share = c.nodes / (c.nodes + c.spares)
  return {"job_mtbf_s": job_mtbf, "failure_rate_per_s": lam, "disk_interval_s": tau,
          "goodput": {"disk_checkpoint_restart": disk, "in_memory_restart": mem, "hotswap": hs},
          # hot swap keeps spare hardware idle; the others need none
          "goodput_per_node": {"disk_checkpoint_restart": disk, "in_memory_restart": mem, "hotswap": hs * share},
          "costs": dataclasses.asdict(c)}


def measured_goodput(useful_steps: int, plain_step_s: float, wall_s: float) -> float:
  """Useful work (steps x failure-free plain step time) / wall time of the run."""
  return useful_steps * plain_step_s / wall_s if wall_s > 0 else float("nan")


def predict_schedule(step_s: float, steps: int, failures: Sequence[str], recovery_s: Dict[str, float],
                     recomputed: Dict[str, float], plain_step_s: float) -> dict:
  """Goodput of a run of ``steps`` steps hit by the listed failure kinds, from costs measured in *other* runs.

  step_s: mean failure-free step time with the layer and the persistent tier as in that run; recovery_s /
  recomputed: per kind, the median recovery time (failure -> every rank's first step of the new generation) and
  steps recomputed, from a calibration run. A failure after step k restored at version v costs its recovery plus
  (k - v - 1) steps (the recovery already ends with one step done). Measured goodput divides the same useful
  work (steps x plain step) by the run's training wall time (first to last step), so the window is the same."""
  any_r = statistics.median(recovery_s.values()) if recovery_s else 0.0
  any_c = statistics.median(recomputed.values()) if recomputed else 1.0
  extra = sum(recovery_s.get(k, any_r) + (recomputed.get(k, any_c) - 1) * step_s for k in failures)
  wall = (steps - 1) * step_s + extra
  return {"wall_s": wall, "goodput": steps * plain_step_s / wall if wall > 0 else float("nan"),
          "failures": len(failures), "unmeasured_kinds": sorted({k for k in failures if k not in recovery_s})}


def goodput_vs_mtbf(c: Costs, node_mtbf_s: Sequence[float]) -> list:
  """Goodput of disk checkpoint/restart, in-memory + restart and hot swap for each node MTBF (PHOENIX-style
  figure): one dict per MTBF, with per-node goodput (hot swap pays for its idle spares)."""
  out = []
  for m in node_mtbf_s:
    p = predict(dataclasses.replace(c, node_mtbf_s=float(m)))
    out.append({"node_mtbf_s": float(m), "job_mtbf_s": p["job_mtbf_s"], "disk_interval_s": p["disk_interval_s"],
                **{f"goodput_{k}": v for k, v in p["goodput"].items()},
                **{f"per_node_{k}": v for k, v in p["goodput_per_node"].items()}})
  return out


def costs_from_benchmark(path_or_dict, node_mtbf_s: float, **overrides) -> Costs:
  """Costs from benchmarks/hotswap.py JSON: every number measured there, with its source (run and field)."""
  d = path_or_dict
  if isinstance(d, str):
    with open(d) as f:
      d = json.load(f)
  m = d.get("measured_costs") or {}
  if m:
    kw = {k: v["value"] for k, v in m.items()}
    kw["sources"] = tuple(sorted((k, v["source"]) for k, v in m.items()))
    kw.update(nodes=d["nodes"], spares=d["spares"], node_mtbf_s=node_mtbf_s)
  else:  # an older benchmark JSON: hot-swap numbers only
    kw = dict(step_s=d["step_time_off_s"], nodes=d["nodes"], spares=d["spares"], node_mtbf_s=node_mtbf_s,
              hotswap_overhead_ratio=d["failure_free_overhead_ratio"], hotswap_recovery_s=d["recovery_time_s"],
              mem_overhead_ratio=d["failure_free_overhead_ratio"],
              sources=(("hotswap_overhead_ratio", "benchmark"), ("hotswap_recovery_s", "benchmark"),
                       ("mem_overhead_ratio", "benchmark"), ("step_s", "benchmark")))
  kw.update(overrides)
  return Costs(**kw)
