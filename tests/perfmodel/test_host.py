"""Measuring on a shared host: timed calls read as a median or a p10, rounds pooled, the probe's reference speed,
what a perfect model scores (the floor), the measuring children, the pinned regime and the calibration gate.

Contention is made synthetically: a seeded share of calls spins longer, as other tenants only ever add time."""
import json
import os
import random
import time

import pytest

from perfmodel.calib import bench, calibrate, nodes, runners, suite
from perfmodel.cost import regime
from perfmodel.calib.host import HostSpeed, kendall_tau

TRAIN = [c["name"] for c in suite.SUITE]
DECODE = [c["name"] for c in suite.INFER]


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
  assert bench.seconds(r, "cpu") == bench.seconds(r, "cpu", "median")  # the default reading
  with pytest.raises(ValueError, match="unknown statistic"):
    bench.seconds(r, "cpu", "mean")


def test_the_p10_reading_of_a_slope_is_the_slope_between_the_two_programs_p10s():
  """TPOT is a slope over two generation lengths: its p10 reading is (p10(fn2) - p10(fn1)) / (x2 - x1), which
  recovers the per-unit cost under contention."""
  state = {"rng": random.Random(3)}

  def make(units):
    def fn():
      _spin(units * 0.4e-3 + (1.5e-3 if state["rng"].random() < 0.5 else 0.0))
      return units
    return fn
  r = bench.time_slope(make(2), make(6), 2, 6, reps=12, block=4)
  assert "slope_of_p10" in r["cpu"] and "slope_of_p10" in bench.view(r, "wall")
  assert bench.seconds(r, "cpu", "p10") == pytest.approx(0.4e-3, rel=0.25)


def test_time_slope_measures_the_per_unit_cost_without_the_program_switch_penalty():
  """The first call after switching programs pays extra (cold caches); time_slope's blocks drop it."""
  state = {"last": None}

  def make(units):
    def fn():
      if state["last"] != units:  # a switch: 4 ms penalty, larger than the 2 ms slope itself
        _spin(4e-3)
      state["last"] = units
      _spin(units * 0.5e-3)
      return units
    return fn
  r = bench.time_slope(make(2), make(6), 2, 6, reps=3, block=3)
  assert r["cpu"]["n"] == 3 and r["clock"] == "wall"
  assert bench.view(r, "cpu")["median"] == pytest.approx(0.5e-3, rel=0.2)


def test_a_measurement_carries_every_reading_and_is_read_in_one():
  r1 = bench.time_fn(_contended(1e-3, 0.6, 2e-3, seed=2), reps=20, warmup=1)
  r2 = bench.time_fn(_contended(1e-3, 0.6, 2e-3, seed=4), reps=20, warmup=1)
  m = runners.readings(r1, r2, {"median": 0.03, "p10": 0.02}, {"wall_s": 1.0})
  assert m["probe_s"] == 0.03 and m["p10"]["probe_s"] == 0.02
  assert m["measured_s"] > m["p10"]["measured_s"] and m["wall_s"] == 1.0
  low = HostSpeed("p10").read(m)
  assert low["measured_s"] == m["p10"]["measured_s"] and low["probe_s"] == 0.02 and low["statistic"] == "p10"
  assert low["wall_s"] == 1.0  # fields without a p10 reading are kept
  assert HostSpeed("median").read(m) is m
  with pytest.raises(ValueError, match="no 'p10' reading"):  # never mixed with a median-only measurement
    HostSpeed("p10").read({"measured_s": 0.01, "noise_pct": 5.0})
  with pytest.raises(ValueError, match="unknown statistic"):
    HostSpeed("p50")


def test_rounds_pool_to_the_median_with_their_spread_as_noise(tmp_path):
  r1 = {n: {"measured_s": t, "noise_pct": 2.0, "host_devices": 1} for n, t in (("a", 1.0), ("b", 2.0))}
  r2 = {n: {**m, "measured_s": 1.5 * m["measured_s"], "noise_pct": 3.0} for n, m in r1.items()}
  one, two = tmp_path / "one.json", tmp_path / "two.json"
  one.write_text(json.dumps(r1))  # a file of one round
  two.write_text(json.dumps({"rounds": [r2]}))
  host = HostSpeed()
  rounds = host.load(str(one)) + host.load(str(two))
  assert len(rounds) == 2 and rounds[0]["a"]["measured_s"] == 1.0
  a = host.pool([c["a"] for c in rounds])
  assert a["measured_s"] == pytest.approx(1.25)  # median of two = their mean
  assert a["round_spread_pct"] == pytest.approx(40.0) and a["noise_pct"] == pytest.approx(20.0)


def _round(times: dict) -> dict:
  return {n: {"measured_s": t, "noise_pct": 1.0} for n, t in times.items()}


def test_the_floor_scores_each_round_against_the_others_as_validation_scores_a_model():
  base = {n: 0.01 * (i + 1) for i, n in enumerate(TRAIN)} | {n: 0.001 * (i + 1) for i, n in enumerate(DECODE)}
  same = [_round(base)] * 3
  floor = HostSpeed().floor(same, TRAIN, DECODE)
  assert floor["train_mape"] == 0.0 and floor["tpot_mape"] == 0.0  # a host that repeats itself exactly
  off = dict(base, **{TRAIN[0]: base[TRAIN[0]] * 1.3})  # one config 30% off in one round
  floor = HostSpeed().floor([_round(base), _round(base), _round(off)], TRAIN, DECODE)
  # round 3 predicted by the others: 1/1.3 - 1 on one config; rounds 1 and 2 by the median of (1, 1.3): 15%
  expect = (2 * 15.0 + 100 * (1 - 1 / 1.3)) / 3 / len(TRAIN)
  assert floor["train_mape"] == pytest.approx(expect) and floor["tpot_mape"] == 0.0
  assert HostSpeed().floor([_round(base)], TRAIN, DECODE) is None  # one round: nothing to compare


def test_the_floor_between_sets_counts_the_suite_only_and_keeps_boots_apart(tmp_path):
  a = {n: 0.01 * (i + 1) for i, n in enumerate(TRAIN)} | {n: 0.001 * (i + 1) for i, n in enumerate(DECODE)}
  b = dict(a)
  b[TRAIN[0]], b[TRAIN[1]] = a[TRAIN[1]], a[TRAIN[0]]  # one discordant pair among the scored configs
  a["c_anchor"], b["c_anchor"] = 1.0, 0.0001  # a program that is not a suite config, timed beside them

  def write(name, times, boot, p10_scale=None):
    m = {n: {"measured_s": t, "noise_pct": 1.0, "regime": {"boot_id": boot}} for n, t in times.items()}
    if p10_scale:
      for n, t in times.items():
        m[n]["p10"] = {"measured_s": t * p10_scale, "noise_pct": 1.0}
    (tmp_path / name).write_text(json.dumps({"rounds": [m, m]}))
  write("x.json", a, "boot1")
  write("y.json", b, "boot2")
  out = HostSpeed().floor_between(sorted(str(p) for p in tmp_path.iterdir()), TRAIN, DECODE)
  n = len(TRAIN)
  for p in out["pairs"]:
    assert p["train_tau"] == pytest.approx(1 - 4 / (n * (n - 1)))  # (C - D) / (n choose 2), D = 1
    assert p["tpot_mape"] == pytest.approx(0.0) and p["train_mape"] > 0 and not p["same_boot"]
  assert out["same_boot"] is None and out["other_boot"]["ordered_pairs"] == 2
  assert out["within_set"]["x.json"]["train_mape"] == 0.0
  write("z.json", a, "boot1", p10_scale=0.9)
  low = HostSpeed("p10").floor_between(sorted(str(p) for p in tmp_path.iterdir()), TRAIN, DECODE)
  assert low["sets"] == ["z.json"]  # only the set that has the p10 reading
  assert kendall_tau([1, 2, 3], [3, 2, 1]) == -1.0


def test_device_references_see_a_child_that_ran_in_a_slow_window():
  # the probe is 1.2x slower with 4 virtual devices; the 4-device child also ran while the host was 1.4x slower,
  # which its one-device bracketing probes (fresh processes, 5% faster than in a measuring child) show
  probes = {1: [0.040, 0.041, 0.039], 4: [0.040 * 1.2 * 1.4] * 3}
  windows = {1: [0.038, 0.038], 4: [0.038 * 1.4, 0.038 * 1.4]}
  refs = HostSpeed.device_references(0.040, probes, windows)
  assert refs[1] == 0.040
  assert refs[4] == pytest.approx(0.040 * 1.2, rel=1e-9)  # the device factor only, not the slow window
  assert HostSpeed.device_references(0.040, probes, {})[4] == pytest.approx(0.040 * 1.2 * 1.4)  # no windows


def test_calibration_step_rounds_pool_to_the_median_at_one_reference_speed():
  def rnd(probe, steps, noise=4.0):
    return {name: {"measured_s": s, "noise_pct": noise, "probe_s": probe * (1.3 if n > 1 else 1.0),
                   "host_devices": n, "window_probe_1dev_s": [probe, probe]}
            for name, (n, s) in steps.items()}
  steps = {"a": (1, 0.010), "m": (2, 0.020)}
  # round 2 ran on a host 2x slower (its probes too); round 3 had an outlier on the multi-device program
  rounds = [rnd(0.030, steps), rnd(0.060, {"a": (1, 0.020), "m": (2, 0.040)}),
            rnd(0.030, {"a": (1, 0.010), "m": (2, 0.013)})]
  out, ref, refs, windows = HostSpeed().calibration_steps(rounds)
  assert ref == pytest.approx(0.030)  # median of all one-device probes
  assert refs[1] == pytest.approx(0.030) and refs[2] == pytest.approx(0.030 * 1.3)
  assert out["a"]["measured_s"] == pytest.approx(0.010)  # the slow round is normalised, not averaged in raw
  assert out["m"]["measured_s"] == pytest.approx(0.020)  # the outlier round is outvoted
  assert out["m"]["rounds"] == pytest.approx([0.020, 0.020, 0.013])
  assert out["m"]["noise_pct"] == pytest.approx(100 * (0.020 - 0.013) / 0.020 / 2)
  assert out["a"]["noise_pct"] == pytest.approx(4.0) and out["a"]["measured_raw_s"] == pytest.approx(0.010)
  one, ref1, _, _ = HostSpeed().calibration_steps([rnd(0.030, steps)])
  assert ref1 == pytest.approx(0.030) and one["m"]["measured_s"] == pytest.approx(0.020)


def test_node_samples_pool_to_the_median_over_trace_children():
  def child(scale, extra=False):
    ss = [{"prog": "p", "name": "dot.1", "cls": "dot", "fp": "a", "t": 1.0 * scale, "t50": 1.5 * scale,
           "tm": 2.0 * scale},
          {"prog": "p", "name": "fusion.2", "cls": "fusion:kLoop", "fp": "b", "t": 4.0 * scale, "t50": 5.0 * scale}]
    if extra:
      ss.append({"prog": "p", "name": "copy.3", "cls": "copy", "fp": "c", "t": 9.0, "t50": 9.0, "tm": 9.0})
    return {"p": ss, "q": [dict(ss[0], prog="q")]}
  # the middle child is 1.45x slow throughout (a process offset): the median child wins, not the mean
  out = nodes.pool_traced([child(1.0), child(1.45, extra=True), child(1.1)])
  by = {s["name"]: s for s in out["p"]}
  assert by["dot.1"]["t"] == pytest.approx(1.1) and by["dot.1"]["t50"] == pytest.approx(1.65)
  assert by["dot.1"]["tm"] == pytest.approx(2.2) and by["dot.1"]["children"] == 3
  assert "tm" not in by["fusion.2"] and by["fusion.2"]["t"] == pytest.approx(4.4)  # a missing statistic stays so
  assert by["copy.3"]["t"] == 9.0 and by["copy.3"]["children"] == 1
  assert [s["name"] for s in out["q"]] == ["dot.1"] and out["q"][0]["t"] == pytest.approx(1.1)


def test_validate_measures_each_entry_in_a_child_with_exactly_its_device_count(tmp_path):
  """Idle virtual devices slow a one-device step 1.23-1.45x, so an entry is measured in a child process with
  exactly the devices experiments.run would give its mesh."""
  s = tmp_path / "suite.py"
  s.write_text(
      "BASE = dict(model=dict(vocab_size=256, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,\n"
      "                       max_seq_len=32), data=dict(seq_len=8, global_batch=4), mesh=dict(data=1),\n"
      "            train=dict(steps=2))\n"
      "SUITE = [dict(name='dp2', mesh=dict(data=2))]\n")
  got = runners.measure_isolated(str(s), ["dp2"], 2, reps=2, probe=False)
  assert got["dp2"]["devices_seen"] == 2 and got["dp2"]["host_devices"] == 2
  assert got["dp2"]["measured_s"] > 0 and got["dp2"]["regime"]["host_malloc"] == "keep_freed"
  assert 0 < got["dp2"]["p10"]["measured_s"] <= got["dp2"]["measured_s"]


def test_pin_regime_sets_single_core_and_single_threaded_xla(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  before = os.sched_getaffinity(0)
  try:
    core = regime.pin()
    assert os.sched_getaffinity(0) == {core} and regime.pinned()
    assert "--xla_cpu_multi_thread_eigen=false" in os.environ["XLA_FLAGS"]
    assert bench.regime()["pinned_core"] == core
  finally:
    for tid in regime._thread_ids():  # noqa: SLF001 (undo for every thread pin() touched)
      try:
        os.sched_setaffinity(tid, before)
      except OSError:
        pass
    os.sched_setaffinity(0, before)


def test_calibration_gate_keeps_the_previous_profile_when_leave_one_out_is_too_high(tmp_path):
  """A fresh calibration above the leave-one-out threshold is moved aside and the previous files come back byte
  for byte; one at or under it stays. A file that did not exist before is moved aside, not left half-made."""
  prof, samples, fresh = tmp_path / "cpu.json", tmp_path / "nodes.json", tmp_path / "new.json"
  prof.write_text('{"old": 1}')
  samples.write_text('{"old samples": 1}')
  snap = calibrate.snapshot([str(prof), str(samples), str(fresh)])
  prof.write_text('{"new": 2}')
  samples.write_text('{"new samples": 2}')
  fresh.write_text('{"made by this calibration": 3}')
  out = calibrate.gate(snap, 20.0, max_loo=15.0, rejected_dir=str(tmp_path / "rejected"))
  assert not out["accepted"] and "20.0%" in out["message"]
  assert prof.read_text() == '{"old": 1}' and samples.read_text() == '{"old samples": 1}' and not fresh.exists()
  assert (tmp_path / "rejected" / "cpu.json").read_text() == '{"new": 2}'
  assert (tmp_path / "rejected" / "new.json").exists() and len(out["rejected_files"]) == 3
  prof.write_text('{"newer": 4}')
  assert calibrate.gate(snap, 15.0, max_loo=15.0, rejected_dir=str(tmp_path / "rejected"))["accepted"]
  assert prof.read_text() == '{"newer": 4}'
  assert calibrate.gate(snap, None)["accepted"]  # no node stage (micro-benchmarks only): nothing to judge
