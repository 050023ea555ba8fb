"""Chrome / Perfetto trace JSON of timelines (open in https://ui.perfetto.dev or chrome://tracing).

The one writer of the performance model's timelines (perfmodel/timeline.py ``Event`` lists): ``perfmodel predict
--trace FILE`` writes the predicted step, ``perfmodel emulate --out DIR`` its emulated ranks. One process per
timeline ("rank 4711 (pipeline:middle)", "predicted step"), with three threads: compute, communication (modelled
collectives) and wait (time spent waiting for peers, e.g. pipeline bubbles, or step overheads). Times are
microseconds from the start of the step.
"""
from __future__ import annotations

import json
import os

TIDS = {"compute": 1, "comm": 2, "wait": 3}


def trace_events(events: list, pid: int, label: str) -> list:
  """Trace events of one timeline's ``events`` (perfmodel.timeline.Event, seconds) as process ``pid``."""
  evs = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}}]
  for name, tid in TIDS.items():
    evs.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
  for e in events:
    evs.append({"name": e.name, "cat": e.cat, "ph": "X", "pid": pid, "tid": TIDS.get(e.cat, 1),
                "ts": round(e.start * 1e6, 3), "dur": round(max(e.dur, 0.0) * 1e6, 3),
                "args": {k: v for k, v in e.args.items()}})
  return evs


def write_file(path: str, evs: list, meta: dict) -> str:
  """One trace file of ``evs`` (from :func:`trace_events`), ``meta`` as its ``otherData``."""
  with open(path, "w") as f:
    json.dump({"traceEvents": evs, "displayTimeUnit": "ms", "otherData": meta}, f, default=str)
  return path


def write(out_dir: str, timelines: list, meta: dict) -> list:
  """timelines: [(label, RankTimeline)]. Writes rank_<id>.json per rank and timeline.json with all."""
  os.makedirs(out_dir, exist_ok=True)
  paths, everything = [], []
  for label, tl in timelines:
    evs = trace_events(tl.events, tl.rank, label)
    everything += evs
    paths.append(write_file(os.path.join(out_dir, f"rank_{tl.rank}.json"), evs, meta))
  paths.append(write_file(os.path.join(out_dir, "timeline.json"), everything, meta))
  return paths
