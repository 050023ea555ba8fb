"""benchmarks/host_floor.py: a perfect model (another measurement of the same configs) scored as `validate`
scores a model -- only the suite's configs count; the calibration anchors timed beside them do not."""
import importlib.util
import json
import os

import pytest

from perfmodel import suite

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = [c["name"] for c in suite.SUITE]
DECODE = [c["name"] for c in suite.INFER]


def _floor():
  spec = importlib.util.spec_from_file_location("hf_bench", os.path.join(ROOT, "benchmarks", "host_floor.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _write(path, times: dict, boot: str):
  m = {n: {"measured_s": t, "probe_s": 1.0, "noise_pct": 1.0, "regime": {"boot_id": boot}} for n, t in times.items()}
  with open(path, "w") as f:
    json.dump({"rounds": [m, m]}, f)


def test_tau_and_mape_count_the_suite_configs_only(tmp_path):
  hf = _floor()
  a = {n: 0.01 * (i + 1) for i, n in enumerate(TRAIN)} | {n: 0.001 * (i + 1) for i, n in enumerate(DECODE)}
  b = dict(a)
  b[TRAIN[0]], b[TRAIN[1]] = a[TRAIN[1]], a[TRAIN[0]]  # one discordant pair among the scored configs
  a["c_anchor"], b["c_anchor"] = 1.0, 0.0001  # an anchor ranked first in one set and last in the other
  _write(tmp_path / "perfmodel_measurements_s1_a.json", a, "boot1")
  _write(tmp_path / "perfmodel_measurements_s2_a.json", b, "boot2")
  out = hf.perfmodel_floor(sorted(str(p) for p in tmp_path.iterdir()))
  n = len(TRAIN)
  for p in out["pairs"]:
    assert p["train_tau"] == pytest.approx(1 - 4 / (n * (n - 1)))  # (C - D) / (n choose 2), D = 1
    assert p["tpot_mape"] == pytest.approx(0.0)
    assert p["train_mape"] > 0 and not p["same_session"]
  assert out["other_session"]["train_tau_at_least_0_9"] == 2 and out["same_session"] is None


def test_the_p10_floor_reads_the_p10_reading_and_leaves_out_sets_without_it(tmp_path):
  hf = _floor()
  a = {n: 0.01 * (i + 1) for i, n in enumerate(TRAIN)}
  _write(tmp_path / "perfmodel_measurements_s1_a.json", a, "boot1")  # median only (before session 28)
  for name, noise in (("s2_a", 1.3), ("s2_b", 1.0)):  # medians differ by 30%, p10 readings agree
    m = {n: {"measured_s": t * noise, "probe_s": 1.0, "noise_pct": 1.0, "regime": {"boot_id": "boot2"},
             "p10": {"measured_s": t, "probe_s": 1.0, "noise_pct": 1.0}} for n, t in a.items()}
    with open(tmp_path / f"perfmodel_measurements_{name}.json", "w") as f:
      json.dump({"rounds": [m, m]}, f)
  paths = sorted(str(p) for p in tmp_path.iterdir())
  low = hf.perfmodel_floor(paths, statistic="p10")
  assert low["sets"] == ["perfmodel_measurements_s2_a.json", "perfmodel_measurements_s2_b.json"]
  assert low["same_session"]["train_mape"] == pytest.approx(0.0) and low["statistic"] == "p10"
  med = hf.perfmodel_floor(paths)
  assert len(med["sets"]) == 3 and med["same_session"]["train_mape"] > 20
