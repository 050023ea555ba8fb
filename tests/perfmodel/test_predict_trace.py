"""``perfmodel predict --trace FILE``: the predicted step's timeline as Chrome / Perfetto trace JSON, written by the
writer emulation uses (perfmodel/emulate/trace.py). The events must tile the predicted step: the compute thread never
overlaps itself, together the threads leave no hole, and the last event ends at the predicted step time."""
import json
import os
import subprocess
import sys

import pytest

from framework.config import from_dict, validate
from perfmodel import hardware, predict, program
from perfmodel.emulate import trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64),
             data=dict(seq_len=32, global_batch=8), mesh=dict(data=2, tensor=2), train=dict(steps=5))
US = 1e-3  # the writer rounds to nanoseconds (microseconds, 3 decimals)


def _timed(doc: dict) -> list:
  return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _check_tiles(doc: dict, step_s: float):
  """The events of one predicted step: inside [0, step], the compute thread in sequence, no holes, ending at step."""
  evs = sorted(_timed(doc), key=lambda e: e["ts"])
  assert len(evs) > 1
  step_us = step_s * 1e6
  tol = US * len(evs)
  assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["ts"] + e["dur"] <= step_us + tol for e in evs)
  assert max(e["ts"] + e["dur"] for e in evs) == pytest.approx(step_us, abs=tol)
  own = [e for e in evs if e["tid"] != trace.TIDS["comm"]]  # compute and wait: one stream
  assert all(a["ts"] + a["dur"] <= b["ts"] + tol for a, b in zip(own, own[1:])), "the compute stream overlaps itself"
  covered, t = 0.0, 0.0
  for e in evs:
    covered += max(0.0, e["ts"] + e["dur"] - max(t, e["ts"]))
    t = max(t, e["ts"] + e["dur"])
  assert covered == pytest.approx(step_us, abs=tol), "the threads leave time in the step unaccounted for"
  names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
  assert names == set(trace.TIDS)


def _written(p, tmp_path) -> dict:
  path = trace.write_file(str(tmp_path / "t.json"), trace.trace_events(p.events, 0, "predicted step"), {})
  with open(path) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def small():
  cfg = validate(from_dict(SMALL), 4)
  return cfg, program.train_step(cfg)


@pytest.mark.parametrize("hw,backend", [("cpu", "auto"), ("cpu", "roofline"), ("h100", "auto")])
def test_compiled_route_trace_tiles_the_predicted_step(small, tmp_path, hw, backend):
  """cpu/auto: the calibrated composition (events scaled to the composed step); roofline: the timeline plus the
  step overhead; h100: a parallel-hardware timeline."""
  cfg, cap = small
  p = predict.predict(cfg, hardware.load(hw), method="compile", captured=cap, backend=backend, trace=True)
  assert p.route == "compile"
  doc = _written(p, tmp_path)
  _check_tiles(doc, p.step_time_s)
  cats = {e["cat"] for e in _timed(doc)}
  assert {"compute", "comm"} <= cats  # data x tensor: the program's collectives are on the comm thread
  assert "events" not in p.to_dict()


@pytest.mark.parametrize("mesh", [dict(data=2, tensor=2), dict(data=2, pipeline=2, microbatches=4)])
def test_analytic_route_trace_tiles_the_predicted_step(tmp_path, mesh):
  d = dict(SMALL, mesh=mesh)
  cfg = validate(from_dict(d), 4)
  p = predict.predict(cfg, hardware.load("cpu"), method="analytic", trace=True)
  doc = _written(p, tmp_path)
  _check_tiles(doc, p.step_time_s)
  names = [e["name"] for e in _timed(doc)]
  if mesh.get("pipeline"):  # the graph is one micro-batch; the schedule's remainder is named as such
    assert p.pipeline_bubble_fraction > 0 and "pipeline: the other micro-batches and the bubble" in names


def test_no_trace_keeps_no_events():
  cfg = validate(from_dict(SMALL), 4)
  assert predict.predict(cfg, hardware.load("cpu"), method="analytic").events is None


def _cli(args, tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "perfmodel", "predict", "--config", "experiments/configs/quickstart.py",
                         "--method", "analytic", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_cli_writes_the_trace_file(tmp_path):
  path = tmp_path / "predicted.json"
  r = _cli(["--trace", str(path)], tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["trace_file"] == str(path)
  doc = json.loads(path.read_text())
  assert doc["otherData"]["step_time_s"] == out["step_time_s"] and doc["otherData"]["route"] == "analytic"
  _check_tiles(doc, out["step_time_s"])


def test_cli_refuses_an_unwritable_trace_path_in_one_line(tmp_path):
  r = _cli(["--trace", str(tmp_path / "no" / "such" / "folder" / "t.json")], tmp_path)
  assert r.returncode == 2 and "Traceback" not in r.stderr
  assert "error: --trace" in r.stderr and "existing writable folder" in r.stderr
