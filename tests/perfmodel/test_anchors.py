"""Speed anchors in `validate`: calibration programs re-measured each round give the host's speed against the
calibration, and each round's measurements are divided by it (perfmodel/anchor.py)."""
import types

import pytest

from perfmodel import anchor, rounds, suite, validate


def test_interleave_spreads_anchors_from_first_to_last():
  names = [f"n{i}" for i in range(14)]
  out = anchor.interleave(names, ["a", "b", "c"])
  assert out[0] == "a" and out[-1] == "c" and sorted(out) == sorted(names + ["a", "b", "c"])
  assert [x for x in out if not x.startswith("n") or x == "n"] == ["a", "b", "c"]
  assert 5 <= out.index("b") <= 9  # the middle one sits in the middle
  assert anchor.interleave(names, []) == names


def test_anchors_are_single_device_calibration_programs_disjoint_from_the_suite():
  cal = {e["name"]: e for e in suite.CALIBRATION}
  assert suite.ANCHORS and all(a in cal for a in suite.ANCHORS)
  assert not set(suite.ANCHORS) & {e["name"] for e in suite.SUITE + suite.INFER}
  assert all(not cal[a].get("mesh") for a in suite.ANCHORS)


def test_anchor_references_come_from_the_calibrations_own_step_times():
  hw = types.SimpleNamespace(calibration={"calibration_loo": [
      {"name": "c1", "type": "train", "measured_s": 0.02}, {"name": "c2", "type": "multi", "measured_s": 0.03},
      {"name": "c3", "type": "train", "measured_s": 0.04}]})
  s = types.SimpleNamespace(ANCHORS=["c1", "c2", "c3", "missing"])
  assert anchor.references(s, hw) == {"c1": 0.02, "c3": 0.04}  # multi-device and unknown ones dropped
  assert anchor.references(types.SimpleNamespace(), hw) == {}


def test_each_round_is_divided_by_its_own_anchor_factor():
  refs = {"c1": 0.02, "c2": 0.04, "c3": 0.05}
  # round 1: host 10% slower than at calibration (one anchor caught in a noisy window), round 2: 20% faster
  c1 = {"c1": {"measured_s": 0.022}, "c2": {"measured_s": 0.044}, "c3": {"measured_s": 0.08}}
  c2 = {"c1": {"measured_s": 0.016}, "c2": {"measured_s": 0.032}, "c3": {"measured_s": 0.04}}
  assert anchor.round_factor(c1, refs)[0] == pytest.approx(1.1)  # the median: the outlier does not move it
  rows = [dict(name="x", predicted_s=0.1, rounds=[{"measured_s": 0.11}, {"measured_s": 0.08}])]
  info = anchor.normalise(rows, [c1, c2], refs)
  assert info["factor_by_round"] == pytest.approx([1.1, 0.8])
  assert [m["measured_anchored_s"] for m in rows[0]["rounds"]] == pytest.approx([0.1, 0.1])
  assert rows[0]["err_anchored_pct"] == pytest.approx(0.0)
  # a round without anchor measurements (an older stored set): no anchored figure
  assert anchor.normalise(rows, [c1, {}], refs) is None


def test_predict_output_is_scaled_by_an_anchor_of_the_same_calibration_only():
  from perfmodel import anchor
  cal = {"date": "2026-12-01T22:23:27", "speed_anchor": {"factor": 0.9, "date": "2026-12-02T07:00:00",
                                                           "calibration_date": "2026-12-01T22:23:27"}}
  hw = types.SimpleNamespace(calibration=cal)
  out = anchor.apply({"mode": "train", "step_time_s": 0.1, "tokens_per_s": 1000.0, "mfu": 0.3, "total_s": 0.5,
                      "peak_memory_bytes": 7}, hw)
  assert out["total_s"] == 0.5  # in train mode: how long the prediction took, not a step time
  inf = anchor.apply({"mode": "infer", "tpot_s": 0.002, "ttft_s": 0.01, "total_s": 0.2}, hw)
  assert (inf["tpot_s"], inf["ttft_s"], inf["total_s"]) == pytest.approx((0.0018, 0.009, 0.18))
  assert out["step_time_s"] == pytest.approx(0.09) and out["tokens_per_s"] == pytest.approx(1000 / 0.9)
  assert out["mfu"] == pytest.approx(0.3 / 0.9) and out["peak_memory_bytes"] == 7  # memory is not a speed
  assert out["speed_anchor"]["applied"] and out["speed_anchor"]["unanchored"]["step_time_s"] == 0.1
  stale = types.SimpleNamespace(calibration=dict(cal, date="2026-12-03T00:00:00"))  # recalibrated since
  out = anchor.apply({"step_time_s": 0.1}, stale)
  assert out["step_time_s"] == 0.1 and not out["speed_anchor"]["applied"]
  out = anchor.apply({"tpot_s": 0.002}, types.SimpleNamespace(calibration={}))
  assert out["tpot_s"] == 0.002 and "calibrate --anchor" in out["speed_anchor"]["reason"]


def test_a_recalibration_drops_the_anchor():
  from perfmodel import calibrate
  assert "speed_anchor" in calibrate.STALE_AFTER_STEPS


def test_probe_then_anchor_maps_the_probes_speed_to_the_programs_speed():
  """Within a round the probe follows drift; the anchors (taken to the reference speed with their neighbours'
  probes, in measurement order) say how far the programs' speed sits from the probe's."""
  refs = {"c1": 0.02, "c2": 0.04}
  # probe at 0.05 s against a 0.04 s reference (host 1.25x slower by the probe); the programs ran 1.25 x 0.9
  cache = {"c1": {"measured_s": 0.02 * 1.125, "probe_s": 0.05}, "x": {"measured_s": 0.1125, "probe_s": 0.05},
           "c2": {"measured_s": 0.04 * 1.125, "probe_s": 0.05}}
  rows = [dict(name="x", predicted_s=0.1, rounds=[dict(cache["x"], host_devices=1)])]
  assert rounds.normalise_rounds(rows, ref=0.04)
  assert rows[0]["rounds"][0]["measured_at_ref_s"] == pytest.approx(0.09)
  factors = anchor.probe_then_normalise(rows, [cache], refs, 0.04)
  assert factors == pytest.approx([0.9])
  assert rows[0]["err_probe_anchored_pct"] == pytest.approx(0.0)


def test_decode_anchors_are_sampler_calibration_programs_priced_against_their_own_tpot():
  cal = {e["name"] for e in suite.CALIBRATION_INFER}
  assert suite.ANCHORS_DECODE and set(suite.ANCHORS_DECODE) <= cal
  hw = types.SimpleNamespace(calibration={"calibration_loo": [
      {"name": "c_decode_b6", "type": "decode", "measured_s": 7e-4}, {"name": "c_d96_l3", "type": "train",
                                                                      "measured_s": 0.015}]})
  assert anchor.references(suite, hw, "decode") == {"c_decode_b6": 7e-4}
  rows = [dict(name="d", predicted_s=1e-4, rounds=[{"measured_s": 1.2e-4}])]
  caches = [{"c_decode_b6": {"measured_s": 8.4e-4}}]
  info = anchor.normalise(rows, caches, {"c_decode_b6": 7e-4}, key="decode_anchored")
  assert info["factor_by_round"] == pytest.approx([1.2]) and rows[0]["err_decode_anchored_pct"] == pytest.approx(0.0)
  assert "err_anchored_pct" not in rows[0]
