"""Chrome / Perfetto trace JSON of emulated ranks (open in https://ui.perfetto.dev or chrome://tracing).

One process per emulated rank ("rank 4711 (pipeline:middle)"), with three threads: compute
(measured), communication (modelled collectives) and wait (time spent waiting for peer stages, i.e.
pipeline bubbles). Times are microseconds from the start of the step.
"""
from __future__ import annotations

import json
import os

TIDS = {"compute": 1, "comm": 2, "wait": 3}


def trace_events(timeline, pid: int, label: str) -> list:
  evs = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}}]
  for name, tid in TIDS.items():
    evs.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
  for e in timeline.events:
    evs.append({"name": e.name, "cat": e.cat, "ph": "X", "pid": pid, "tid": TIDS.get(e.cat, 1),
                "ts": round(e.start * 1e6, 3), "dur": round(max(e.dur, 0.0) * 1e6, 3),
                "args": {k: v for k, v in e.args.items()}})
  return evs


def write(out_dir: str, timelines: list, meta: dict) -> list:
  """timelines: [(label, RankTimeline)]. Writes rank_<id>.json per rank and timeline.json with all."""
  os.makedirs(out_dir, exist_ok=True)
  paths, everything = [], []
  for i, (label, tl) in enumerate(timelines):
    evs = trace_events(tl, tl.rank, label)
    everything += evs
    p = os.path.join(out_dir, f"rank_{tl.rank}.json")
    with open(p, "w") as f:
      json.dump({"traceEvents": evs, "displayTimeUnit": "ms", "otherData": meta}, f)
    paths.append(p)
  p = os.path.join(out_dir, "timeline.json")
  with open(p, "w") as f:
    json.dump({"traceEvents": everything, "displayTimeUnit": "ms", "otherData": meta}, f)
  paths.append(p)
  return paths
