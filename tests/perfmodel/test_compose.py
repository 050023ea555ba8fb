"""Step compositions: named terms, the features a step is made of, and the typed fit that recovers known laws."""
import dataclasses
import json

import numpy as np
import pytest

from perfmodel import compose, hardware
from perfmodel.calib import fit, runners, suite
from perfmodel.compositions import TERMS, Calibration, Composition, Form, StepFeatures
from perfmodel.graph.nodes import ExecGraph, Region


def F(**kw) -> StepFeatures:
  return StepFeatures(**kw)


def test_a_form_sums_named_terms_and_splits_bytes_at_its_knee():
  form = Form(coef={"node_seconds": 1.3, "node_executions": 2e-6, "devices": 1e-4, "collective_seconds": 2.0,
                    "collective_executions": 5e-6})
  f1 = F(node_seconds=0.01, node_executions=400, devices=1)
  f2 = F(node_seconds=0.02, node_executions=800, devices=2, collective_seconds=1e-3, collective_executions=4)
  assert form.seconds(f1) == pytest.approx(1.3 * 0.01 + 2e-6 * 400 + 1e-4)
  assert form.seconds(f2) == pytest.approx(2 * form.seconds(f1) + 2.0 * 1e-3 + 5e-6 * 4)
  knee = 4.0 * 2 ** 20
  piecewise = Form(coef={"node_bytes": 2e-11, "node_bytes_beyond_knee": 5e-11}, knee=knee)
  assert piecewise.seconds(F(node_bytes=3 * knee)) == pytest.approx(2e-11 * knee + 5e-11 * 2 * knee)
  assert Form(coef={"node_bytes": 3e-11}).seconds(F(node_bytes=3 * knee)) == pytest.approx(3e-11 * 3 * knee)
  with pytest.raises(ValueError, match="unknown composition term"):
    Form.from_dict({"a": 1.0})


def test_the_committed_calibration_is_typed_and_round_trips():
  hw = hardware.load("cpu")
  cal = hw.calibration
  assert isinstance(cal, Calibration) and set(cal.compositions) == {"learned", "profiled", "hybrid"}
  comp = cal.compositions["learned"]
  assert set(comp.forms) == {"train", "multi", "decode"} and set(comp.forms["train"].coef) == set(TERMS)
  assert comp.loo and comp.loo_mape == pytest.approx(np.mean([abs(r["err_pct"]) for r in comp.loo]), rel=1e-5)
  assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal
  with pytest.raises(ValueError, match="unknown calibration field"):
    Calibration.from_dict({"composition": {}})


def test_features_count_devices_nodes_and_fresh_temp_bytes_only_above_the_mmap_threshold():
  """A step whose temp buffer exceeds glibc's 32 MiB mmap threshold page-faults it afresh every step."""
  g = ExecGraph(regions={"main": Region(name="main", nodes=[])}, entry="main", n_devices=2)
  small = compose.step_features(g, lambda n: 0.0, 2, temp_bytes=compose.FRESH_ALLOC_THRESHOLD)
  big = compose.step_features(g, lambda n: 0.0, 2, temp_bytes=compose.FRESH_ALLOC_THRESHOLD + 4096)
  assert small.fresh_temp_bytes == 0.0 and big.fresh_temp_bytes == 2 * (compose.FRESH_ALLOC_THRESHOLD + 4096)
  assert big.devices == 2 and compose.step_features(g, lambda n: 0.0, 2, per_step=False).devices == 0.0
  # malloc keeping freed blocks faults nothing afresh: explicitly, or because the profile was calibrated that way
  assert compose.step_features(g, lambda n: 0.0, 2, temp_bytes=2 ** 30, keeps=True).fresh_temp_bytes == 0.0
  kept = dataclasses.replace(hardware.load("cpu"), calibration=Calibration(host_malloc="keep_freed"))
  assert compose.step_features(g, lambda n: 0.0, 2, temp_bytes=2 ** 30, hw=kept).fresh_temp_bytes == 0.0
  assert "fresh_temp_bytes" in fit.TYPE_TERMS["train"] and "fresh_temp_bytes" not in fit.TYPE_TERMS["decode"]


def test_pow2_tokens_counts_tokens_per_device():
  cfg = lambda **kw: runners.entry_cfg({"name": "x", **kw})[0]  # noqa: E731
  assert compose.pow2_tokens(cfg())  # BASE: 8 x 64 = 512 tokens
  assert not compose.pow2_tokens(cfg(data=dict(seq_len=48)))  # 384
  assert compose.pow2_tokens(cfg(mesh=dict(data=2)))  # 256 per device
  assert not compose.pow2_tokens(cfg(data=dict(global_batch=6), mesh=dict(data=2)))  # 192 per device
  # every validation config is a power-of-two step; calibration has both kinds, so the fit can tell them apart
  assert all(compose.pow2_tokens(runners.entry_cfg(e)[0]) for e in suite.SUITE)
  assert {compose.pow2_tokens(runners.entry_cfg(e)[0]) for e in suite.CALIBRATION if "mesh" not in e} == {True, False}


def test_nnls_recovers_known_coefficients_from_exact_data():
  rng = np.random.default_rng(0)
  law = Form(coef={"node_seconds": 1.3, "node_executions": 2e-6, "devices": 1e-4})
  rows = [F(node_seconds=rng.uniform(1e-3, 1), node_executions=float(rng.integers(100, 5000)), devices=n)
          for n in (1, 1, 1, 2, 4, 1, 2, 8, 1, 4)]
  got = fit._fit_terms(rows, [law.seconds(r) for r in rows], ("node_seconds", "node_executions", "devices"))  # noqa: SLF001
  for t in ("node_seconds", "node_executions", "devices"):
    assert got.coef[t] == pytest.approx(law.coef[t], rel=1e-3)


def test_train_fit_learns_the_power_of_two_scale():
  rng = np.random.default_rng(1)
  rows, y = [], []
  for i in range(12):
    a, pow2 = rng.uniform(1e-3, 0.1), i % 3 == 0
    rows.append(F(node_seconds=a, node_executions=float(rng.integers(100, 5000)), devices=1,
                  pow2_node_seconds=a if pow2 else 0.0))
    y.append(1.1 * a + 1e-4 + (0.25 * a if pow2 else 0.0))
  form = fit.fit_typed(rows, y, ["train"] * len(rows))["train"]
  assert form.coef["node_seconds"] == pytest.approx(1.1, rel=1e-3)
  assert form.coef["pow2_node_seconds"] == pytest.approx(0.25, rel=1e-2)


def test_multi_device_steps_borrow_the_training_power_of_two_term_only_without_their_own():
  """No multi-device calibration program is a power-of-two step: the multi type takes the training type's term (a
  power-of-two multi-device step is priced with it, another is not) and leaves its own fit alone."""
  rng = np.random.default_rng(2)
  rows, y, types = [], [], []
  for i in range(12):  # single-device steps, a third of them power-of-two
    a, pow2 = rng.uniform(1e-3, 0.1), i % 3 == 0
    rows.append(F(node_seconds=a, node_executions=1000, devices=1, pow2_node_seconds=a if pow2 else 0.0))
    y.append(1.1 * a + (0.25 * a if pow2 else 0.0))
    types.append("train")
  for _ in range(6):  # two-device steps, none power-of-two
    a, coll = rng.uniform(1e-3, 0.1), rng.uniform(1e-4, 1e-2)
    rows.append(F(node_seconds=a, node_executions=1000, devices=2, collective_seconds=coll, collective_executions=4))
    y.append(1.3 * a + 2.0 * coll)
    types.append("multi")
  forms = fit.fit_typed(rows, y, types)
  multi = forms["multi"].coef
  assert multi["node_seconds"] == pytest.approx(1.3, rel=1e-3) and multi["collective_seconds"] == pytest.approx(2.0)
  assert multi["pow2_node_seconds"] == pytest.approx(forms["train"].coef["pow2_node_seconds"])
  assert multi["pow2_node_seconds"] == pytest.approx(0.25, rel=1e-2)
  comp = Composition(forms=forms)
  f = F(node_seconds=0.05, node_executions=1000, devices=2, collective_seconds=1e-3, collective_executions=4)
  boost = comp.seconds(dataclasses.replace(f, pow2_node_seconds=0.05), "multi") - comp.seconds(f, "multi")
  assert boost == pytest.approx(0.25 * 0.05, rel=1e-2)


def test_decode_fit_takes_a_signed_per_thunk_term_and_training_stays_non_negative():
  """Rows from a known law with a negative per-thunk term (traced node times each carrying a fixed tracing cost):
  the decode type recovers it; the training type, whose terms are all non-negative, cannot."""
  rng = np.random.default_rng(0)
  rows, y = [], []
  for _ in range(8):
    execs = float(rng.integers(50, 800))
    node_sum = execs * float(rng.uniform(1e-6, 8e-6))
    nbytes = float(rng.uniform(1e5, 3e6))
    rows.append(F(node_seconds=node_sum, node_executions=execs, node_bytes=nbytes))
    y.append(0.5 * node_sum - 0.4e-6 * execs + 2e-11 * nbytes)
  form = fit.fit_typed(rows, y, ["decode"] * len(rows))["decode"]
  assert form.coef["node_executions"] == pytest.approx(-0.4e-6, rel=0.05)
  assert form.coef["node_seconds"] == pytest.approx(0.5, rel=0.05)
  for r, t in zip(rows, y):
    assert form.seconds(r) == pytest.approx(t, rel=0.02)
  assert min(fit.fit_typed(rows, y, ["train"] * len(rows))["train"].coef.values()) >= 0.0


def test_decode_bytes_are_priced_piecewise_and_the_knee_is_recovered_by_leave_one_out():
  """Decode time per byte rises once the step's bytes leave the core's cache; the fit picks the knee from its grid
  by leave-one-out over the decode rows alone."""
  knee = fit.KNEES[3]
  law = Form(coef={"node_bytes": 2.5e-11, "node_bytes_beyond_knee": 5e-11}, knee=knee)
  rows = [F(node_seconds=1e-4, node_executions=120, node_bytes=b * knee) for b in (0.4, 0.8, 1.5, 3, 6, 11)]
  form = fit.fit_typed(rows, [law.seconds(r) for r in rows], ["decode"] * len(rows))["decode"]
  assert form.knee == knee
  assert form.coef["node_bytes"] == pytest.approx(2.5e-11, rel=1e-3)
  assert form.coef["node_bytes_beyond_knee"] == pytest.approx(5e-11, rel=1e-3)


def test_leave_one_program_out_predicts_each_row_from_the_others():
  rng = np.random.default_rng(3)
  rows = [F(node_seconds=rng.uniform(1e-3, 0.1), devices=1) for _ in range(6)]
  y = [1.2 * r.node_seconds for r in rows]
  comp = fit.fit(rows, y, ["train"] * 6, [f"p{i}" for i in range(6)], [1.0] * 6)
  assert [r["name"] for r in comp.loo] == [f"p{i}" for i in range(6)]
  assert comp.loo_mape == pytest.approx(0.0, abs=1e-6)
  y[0] *= 1.5  # one program off the law: its own prediction (from the others) misses it by a third
  assert fit.loo_typed(rows, y, ["train"] * 6, list("abcdef"), [0.0] * 6)[0]["err_pct"] == pytest.approx(-100 / 3,
                                                                                                          rel=1e-3)
