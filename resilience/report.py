"""What a hot-swap run reports: ``hotswap_summary.json`` (what ``run_hotswap`` returns), built from the run state."""
from __future__ import annotations

import os
import time
from typing import Dict, List

from resilience.injection import Fault
from resilience.run_state import Commits, EventLog, Membership, Trajectory
from resilience.settings import HotswapSettings


def summary(s: HotswapSettings, total_steps: int, workdir: str, membership: Membership, commits: Commits,
            trajectory: Trajectory, done: Dict[int, dict], recoveries: List[dict], faults: List[Fault],
            events: EventLog) -> dict:
  """``done``: the last generation's final messages by rank; ``recoveries``: the finished recoveries' reports."""
  tr = trajectory
  fired = [f for f in faults if f.fired]
  on = [x["dt"] for x in tr.step_times if x["on"] and not x["first"] and not x["transition"]]
  off = [x["dt"] for x in tr.step_times if not x["on"] and not x["first"] and not x["transition"]]
  done = [done[r] for r in sorted(done)]
  resumed = events.first("resume")
  return {"steps": total_steps, "nodes": s.nodes, "spares": s.spares, "replicas": s.replicas,
          "generations": membership.gen + 1, "failures_injected": sum(2 if f.kind in ("two",) or
                                                                      (f.kind == "recovery" and f.stage) else 1
                                                                      for f in fired if f.kind != "spare"),
          "spares_killed": sum(1 for f in fired if f.kind == "spare"),
          "recoveries": recoveries, "losses": {str(k): v for k, v in sorted(tr.losses.items())},
          "loss_mismatch_on_recompute": tr.loss_mismatch, "recompute_checks": tr.recompute_checks,
          "final_crc": [d["final_crc"] for d in done],
          "snapshot_bytes_per_rank": done[0].get("snapshot_bytes") if done else None,
          "snapshot_copy_ms_median": done[0].get("snap_copy_ms_median") if done else None,
          "snapshot_crc_ms_median": done[0].get("snap_crc_ms_median") if done else None,
          "snapshots_skipped": sum(d.get("snapshots_skipped") or 0 for d in done),
          "persist_every": s.persist_every, "persist_saves": done[0].get("persist_saves") if done else None,
          "persist_save_ms_median": done[0].get("persist_save_ms_median") if done else None,
          "resumed_from": resumed["version"] if resumed else None,
          "startup_s": startup_breakdown(trajectory, events),
          "step_log": tr.step_times,
          "step_times_on_s": on, "step_times_off_s": off, "committed": commits.committed,
          "wall_s": time.time() - events.t0, "workdir": workdir,
          "train_wall_s": tr.t_last_step - (tr.t_first_step or 0.0),
          "events": os.path.join(workdir, "hotswap_events.jsonl")}


def startup_breakdown(trajectory: Trajectory, events: EventLog) -> dict:
  """Seconds from this launch to its first step, and the slowest rank's phases of generation 0."""
  t = trajectory.start_timings
  ready = events.first("agents_ready")
  out = {"agents_ready": ready["t"] if ready else None,
         "first_step": (trajectory.t_first_step - events.t0) if trajectory.t_first_step else None}
  if t:
    for name, a, b in (("jax_init", "t_start", "t_init"), ("build", "t_init", "t_built"),
                       ("restore", "t_built", "t_restored"), ("compile", "t_restored", "t_compiled")):
      out[name] = max(x[b] - x[a] for x in t.values())
    out["tier"] = next(iter(t.values()))["tier"]
  return out
