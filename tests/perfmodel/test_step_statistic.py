"""Which reading of a step time is compared: the median of the timed calls or their 10th percentile (p10).

On a shared host other tenants only ever add time to a call (contention for caches and memory still counts in
CPU time). The tests below make that contention synthetically, with a seeded share of calls that spin longer,
and check that the p10 reading recovers the uncontended cost where the median does not; that a measurement
carries both readings and is read in the profile's one; and that an old measurement without a p10 reading is
refused rather than mixed in."""
import random
import time

import pytest

from perfmodel import bench, rounds


def _spin(seconds):
  c = time.process_time()
  while time.process_time() - c < seconds:
    pass


def _contended(base_s, share, extra_s, seed):
  rng = random.Random(seed)

  def fn():
    _spin(base_s + (extra_s if rng.random() < share else 0.0))
    return 0
  return fn


def test_the_p10_reading_of_a_step_is_its_uncontended_time_where_the_median_is_not():
  # 60% of calls contended (+2 ms on a 1 ms call): the median lands on a contended call, the p10 does not
  r = bench.time_fn(_contended(1e-3, 0.6, 2e-3, seed=1), reps=40, warmup=1)
  assert bench.seconds(r, "cpu", "p10") == pytest.approx(1e-3, rel=0.15)
  assert bench.seconds(r, "cpu", "median") > 2e-3
  assert bench.seconds(r, "cpu") == bench.seconds(r, "cpu", "median")  # the default reading is unchanged
  with pytest.raises(ValueError, match="unknown statistic"):
    bench.seconds(r, "cpu", "mean")


def test_the_p10_reading_of_a_slope_is_the_slope_between_the_two_programs_p10s():
  """TPOT is a slope over two generation lengths: its p10 reading is (p10(fn2) - p10(fn1)) / (x2 - x1), which
  recovers the per-unit cost under contention; the median of per-round slopes is pulled by it."""
  state = {"rng": random.Random(3)}

  def make(units):
    def fn():
      _spin(units * 0.4e-3 + (1.5e-3 if state["rng"].random() < 0.5 else 0.0))
      return units
    return fn
  r = bench.time_slope(make(2), make(6), 2, 6, reps=12, block=4)
  assert "slope_of_p10" in r["cpu"] and "slope_of_p10" in bench.view(r, "wall")
  assert bench.seconds(r, "cpu", "p10") == pytest.approx(0.4e-3, rel=0.25)


def test_a_measurement_carries_both_readings_and_is_read_in_one():
  from perfmodel.validate import _both_statistics
  r1 = bench.time_fn(_contended(1e-3, 0.6, 2e-3, seed=2), reps=20, warmup=1)
  r2 = bench.time_fn(_contended(1e-3, 0.6, 2e-3, seed=4), reps=20, warmup=1)
  m = _both_statistics(r1, r2, {"median": 0.03, "p10": 0.02}, {"wall_s": 1.0})
  assert m["probe_s"] == 0.03 and m["p10"]["probe_s"] == 0.02
  assert m["measured_s"] > m["p10"]["measured_s"] and m["wall_s"] == 1.0
  low = rounds.with_statistic(m, "p10")
  assert low["measured_s"] == m["p10"]["measured_s"] and low["probe_s"] == 0.02 and low["statistic"] == "p10"
  assert low["wall_s"] == 1.0  # fields without a p10 reading are kept
  assert rounds.with_statistic(m, "median") is m
  old = {"measured_s": 0.01, "noise_pct": 5.0}  # a set stored before session 28
  with pytest.raises(ValueError, match="no 'p10' reading"):
    rounds.with_statistic(old, "p10")


def test_round_spread_is_reported_for_every_reading_all_rounds_have():
  def m(med, low):
    return {"measured_s": med, "noise_pct": 1.0, "p10": {"measured_s": low, "noise_pct": 1.0}}
  caches = [{"a": m(1.0, 0.9), "t": m(2.0, 1.0)}, {"a": m(1.2, 0.91), "t": m(2.0, 1.1)}]
  got = rounds.round_spread_by_statistic(caches, ["a"], ["t"])
  assert got["median"]["train"] == pytest.approx(100 * 0.2 / 1.1)
  assert got["p10"]["train"] == pytest.approx(100 * 0.01 / 0.905)
  assert got["p10"]["tpot"] == pytest.approx(100 * 0.1 / 1.05) and got["median"]["tpot"] == 0.0
  caches[1]["a"] = {"measured_s": 1.1, "noise_pct": 1.0}  # one round without the p10 reading: median only
  got = rounds.round_spread_by_statistic(caches, ["a"], [])
  assert set(got) == {"median"}
  assert rounds.round_spread_by_statistic(caches[:1], ["a"], []) is None
