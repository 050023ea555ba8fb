"""What a hot-swap run reports: ``hotswap_summary.json`` (what ``run_hotswap`` returns).

Mixed into :class:`resilience.controller.Controller` (it reads its bookkeeping).
"""
from __future__ import annotations

import os
import time


class ReportMixin:
  def summary(self) -> dict:
    fired = [f for f in self.faults if f.fired]
    on = [x["dt"] for x in self.step_times if x["on"] and not x["first"] and not x["transition"]]
    off = [x["dt"] for x in self.step_times if not x["on"] and not x["first"] and not x["transition"]]
    done = [self.done[r] for r in sorted(self.done)]
    return {"steps": self.total, "nodes": self.s.nodes, "spares": self.s.spares, "replicas": self.s.replicas,
            "generations": self.gen + 1, "failures_injected": sum(2 if f.kind in ("two",) or
                                                                  (f.kind == "recovery" and f.stage) else 1
                                                                  for f in fired if f.kind != "spare"),
            "spares_killed": sum(1 for f in fired if f.kind == "spare"),
            "recoveries": self.recoveries, "losses": {str(k): v for k, v in sorted(self.losses.items())},
            "loss_mismatch_on_recompute": self.loss_mismatch, "recompute_checks": self.recompute_checks, "final_crc": [d["final_crc"] for d in done],
            "snapshot_bytes_per_rank": done[0].get("snapshot_bytes") if done else None,
            "snapshot_copy_ms_median": done[0].get("snap_copy_ms_median") if done else None,
            "snapshot_crc_ms_median": done[0].get("snap_crc_ms_median") if done else None,
            "snapshots_skipped": sum(d.get("snapshots_skipped") or 0 for d in done),
            "persist_every": self.s.persist_every, "persist_saves": done[0].get("persist_saves") if done else None,
            "persist_save_ms_median": done[0].get("persist_save_ms_median") if done else None,
            "resumed_from": next((e["version"] for e in self.events if e["event"] == "resume"), None),
            "startup_s": self.startup_breakdown(),
            "step_log": self.step_times,
            "step_times_on_s": on, "step_times_off_s": off, "committed": self.committed,
            "wall_s": time.time() - self.t0, "workdir": self.workdir,
            "train_wall_s": getattr(self, "t_last_step", 0.0) - (getattr(self, "t_first_step", None) or 0.0),
            "events": os.path.join(self.workdir, "hotswap_events.jsonl")}

  def startup_breakdown(self) -> dict:
    """Seconds from this launch to its first step, and the slowest rank's phases of generation 0."""
    t = self.start_timings
    ready = next((e["t"] for e in self.events if e["event"] == "agents_ready"), None)
    out = {"agents_ready": ready,
           "first_step": (self.t_first_step - self.t0) if getattr(self, "t_first_step", None) else None}
    if t:
      for name, a, b in (("jax_init", "t_start", "t_init"), ("build", "t_init", "t_built"),
                         ("restore", "t_built", "t_restored"), ("compile", "t_restored", "t_compiled")):
        out[name] = max(x[b] - x[a] for x in t.values())
      out["tier"] = next(iter(t.values()))["tier"]
    return out

