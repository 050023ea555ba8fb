"""Closed forms: collectives (alpha-beta), pipeline bubbles (formula == simulation), timeline overlap, profiles."""
import numpy as np
import pytest

from perfmodel import collectives as C
from perfmodel import hardware, pipeline
from perfmodel.costs import Chain, Roofline
from perfmodel.graph import CollectiveInfo, ExecGraph, Node, Region
from perfmodel.hardware import HardwareProfile, LinkLevel
from perfmodel.timeline import schedule


def test_ring_tree_formulas():
  S, B, a = 1e9, 100e9, 5e-6
  assert C.ring_all_reduce(S, 8, B, a) == pytest.approx(2 * 7 / 8 * S / B + 14 * a)
  assert C.ring_all_gather(S, 4, B, a) == pytest.approx(3 / 4 * S / B + 3 * a)
  assert C.tree_all_reduce(S, 8, B, a) == pytest.approx(2 * S / B + 6 * a)
  assert C.ring_all_reduce(S, 1, B, a) == 0.0


def _hw(links):
  return HardwareProfile(name="t", device_kind="t", peak_flops={"f32": 1e12}, mem_bandwidth=1e12, mem_bytes=1e9,
                         launch_overhead=0.0, links=tuple(links))


def test_auto_picks_tree_for_small_messages_and_ring_for_large():
  hw = _hw([LinkLevel("ib", 0, 50e9, 10e-6, "fat-tree")])
  small = C.cost("all-reduce", 1e3, tuple(range(64)), hw)
  large = C.cost("all-reduce", 1e10, tuple(range(64)), hw)
  assert small.algorithm == "tree" and large.algorithm == "ring"


def test_hierarchical_allreduce_uses_island_then_network():
  nv, ib = LinkLevel("nvlink", 8, 450e9, 3e-6), LinkLevel("ib", 0, 50e9, 6e-6, "fat-tree")
  hw = _hw([nv, ib])
  S = 1e9
  inside = C.cost("all-reduce", S, tuple(range(8)), hw)
  assert inside.level == "nvlink" and inside.seconds == pytest.approx(C.ring_all_reduce(S, 8, 450e9, 3e-6))
  across = C.cost("all-reduce", S, tuple(range(32)), hw, algorithm="ring")
  expect = 2 * C.ring_all_gather(S, 8, 450e9, 3e-6) + C.ring_all_reduce(S / 8, 4, 50e9, 6e-6)
  assert across.algorithm == "hierarchical" and across.seconds == pytest.approx(expect)
  # a strided group (one device per island) goes over IB only
  strided = C.cost("all-reduce", S, (0, 8, 16, 24), hw, algorithm="ring")
  assert strided.seconds == pytest.approx(2 * 0 + C.ring_all_reduce(S, 4, 50e9, 6e-6) + 0)


def test_torus_uses_all_dimensions():
  hw = _hw([LinkLevel("ici", 256, 50e9, 1e-6, "torus2d")])
  t = C.cost("all-gather", 1e9, tuple(range(16)), hw)
  assert t.seconds == pytest.approx(C.ring_all_gather(1e9, 16, 4 * 50e9, 1e-6))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (8, 16), (3, 1)])
@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_pipeline_formula_equals_simulation(p, m, schedule_name):
  f, b = 1.0, 2.0
  sim = pipeline.simulate(schedule_name, p, m, f, b)
  closed = pipeline.cost(schedule_name, p, m, f, b)
  assert sim["step_time"] == pytest.approx(closed.step_time)
  assert sim["bubble_fraction"] == pytest.approx(closed.bubble_fraction)
  assert closed.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
  # 1F1B bounds live activations by p; GPipe keeps all m
  assert sim["in_flight"] == (min(p, m) if schedule_name == "1f1b" else m)


def test_interleaved_bubble_shrinks_with_chunks():
  a = pipeline.cost("interleaved", 4, 8, 1.0, 2.0, v=1)
  b = pipeline.cost("interleaved", 4, 8, 1.0, 2.0, v=4)
  assert a.step_time == pytest.approx(pipeline.cost("1f1b", 4, 8, 1.0, 2.0).step_time)
  assert b.step_time == pytest.approx((8 + 3 / 4) * 3.0)
  assert b.bubble_fraction < a.bubble_fraction


def test_timeline_overlaps_async_but_not_sync_collectives():
  hw = _hw([LinkLevel("l", 0, 1e9, 0.0)])
  info = lambda a: CollectiveInfo("all-reduce", 2, 1, 1e6, "{{0,1}}", is_async=a, n_devices=2)  # 2 ms ring AR / 2
  comp = lambda i, d: Node(id=i, name=f"c{i}", kind="fusion", opcode="fusion", bytes=1e9, deps=d)  # 1 ms at 1 TB/s
  nodes_async = [comp(0, ()), Node(id=1, name="ar", kind="collective", opcode="all-reduce-start", deps=(0,),
                                   collective=info(True)),
                 comp(2, (0,)), Node(id=3, name="w", kind="wait", opcode="all-reduce-done", deps=(1,), start=1)]
  nodes_sync = [comp(0, ()), Node(id=1, name="ar", kind="collective", opcode="all-reduce", deps=(0,),
                                  collective=info(False)), comp(2, (0,))]
  chain = Chain([Roofline(hw)], hw)
  t_comm = C.ring_all_reduce(1e6, 2, 1e9, 0.0)
  ta = schedule(ExecGraph({"e": Region("e", nodes_async)}, "e", 2), chain)
  ts = schedule(ExecGraph({"e": Region("e", nodes_sync)}, "e", 2), chain)
  assert ts.makespan == pytest.approx(2e-3 + t_comm)
  assert ta.makespan == pytest.approx(1e-3 + max(1e-3, t_comm))
  assert ta.exposed_comm == pytest.approx(max(0.0, t_comm - 1e-3))


def test_loop_region_multiplies_by_trip_count():
  hw = _hw([])
  body = [Node(id=1, name="b", kind="fusion", opcode="f", bytes=1e9)]
  entry = [Node(id=0, name="l", kind="loop", opcode="while", body="body", trip_count=7)]
  tl = schedule(ExecGraph({"e": Region("e", entry), "body": Region("body", body)}, "e", 1), Chain([Roofline(hw)], hw))
  assert tl.makespan == pytest.approx(7e-3)


@pytest.mark.parametrize("name", ["cpu", "a100", "h100", "h200", "tpu_v5e", "tpu_v5p"])
def test_profiles_load_with_sources(name):
  hw = hardware.load(name)
  assert hw.peak("bf16") > 0 and hw.mem_bandwidth > 0 and hw.links
  assert all(hw.sources.get(k) for k in ("mem_bandwidth", "mem_bytes", "launch_overhead")), hw.sources
  if name == "h200":
    assert hw.mem_bytes == 141e9 and hw.mem_bandwidth == 4.8e12 and hw.peak("bf16") == 989e12


def test_learned_backend_interpolates_by_physics_and_flags_out_of_range():
  from perfmodel import learned
  from perfmodel.costs import Calibrated
  hw = hardware.load("cpu")
  if not hw.calibrated:
    pytest.skip("cpu profile not calibrated")
  mk = lambda i, b: Node(id=i, name=f"f{i}", kind="fusion", opcode="fusion:kLoop", bytes=b, flops=b / 4)  # noqa: E731
  phys = Calibrated(hw)
  # samples measured at exactly 2x the physical estimate
  samples = [{"cls": "fusion:kLoop", "f": learned.features(mk(i, b)), "t": 2 * phys.price(mk(i, b)).seconds,
              "phys": phys.price(mk(i, b)).seconds} for i, b in enumerate((1e4, 3e4, 1e5, 3e5, 1e6))]
  model = learned.Learned(hw, samples=samples)
  q = mk(99, 2e5)
  p = model.price(q)
  assert p.backend == "learned"
  assert p.seconds == pytest.approx(2 * phys.price(q).seconds, rel=1e-6)
  far = model.price(mk(98, 1e9))
  assert far.backend == "learned(out-of-range)" and far.seconds == pytest.approx(2 * phys.price(mk(98, 1e9)).seconds)
  assert model.price(Node(id=5, name="x", kind="loop", opcode="while")) is None


def test_learned_backend_scales_neighbours_by_working_set_and_tells_layout_changes():
  import dataclasses
  from perfmodel import learned
  from perfmodel.costs import Calibrated
  hw = hardware.load("cpu")
  if not hw.calibrated:
    pytest.skip("cpu profile not calibrated")
  mk = lambda i, b, P=1e6: Node(id=i, name=f"f{i}", kind="fusion", opcode="fusion:kLoop", bytes=b,  # noqa: E731
                                flops=b / 4, program_bytes=P)
  phys = Calibrated(hw)
  samples = [{"cls": "fusion:kLoop", "f": learned.features(mk(i, b)), "t": 2 * phys.price(mk(i, b)).seconds,
              "phys": phys.price(mk(i, b)).seconds, "P": 1e6} for i, b in enumerate((1e4, 3e4, 1e5, 3e5))]
  q = mk(99, 5e4, P=4e6)  # a node of a program that streams 4x the bytes
  base = 2 * phys.price(q).seconds
  assert learned.Learned(hw, samples=samples, beta=0.0).price(q).seconds == pytest.approx(base, rel=1e-6)
  assert learned.Learned(hw, samples=samples, beta=0.5).price(q).seconds == pytest.approx(2 * base, rel=1e-6)
  # a graph built without the context (program_bytes 0) is priced without scaling
  q0 = dataclasses.replace(q, program_bytes=0.0)
  assert learned.Learned(hw, samples=samples, beta=0.5).price(q0).seconds == pytest.approx(base, rel=1e-6)
  # layout changes, from the opcode or from the fused ops XLA names the fusion after
  assert learned.changes_layout(Node(id=1, name="copy_bitcast_fusion.4", kind="fusion", opcode="fusion:kLoop"))
  assert learned.changes_layout(Node(id=2, name="copy.3", kind="fusion", opcode="copy"))
  assert not learned.changes_layout(Node(id=3, name="multiply_add_fusion.7", kind="fusion", opcode="fusion:kLoop"))


def test_learned_samples_of_another_features_version_are_refused(tmp_path):
  import json
  from perfmodel import learned
  hw = hardware.load("cpu")
  path = tmp_path / "old.json"
  path.write_text(json.dumps({"meta": {}, "samples": []}))  # no version: written before versioning (1)
  with pytest.raises(ValueError, match="features version 1.*perfmodel calibrate"):
    learned.Learned(hw, path=str(path))


def test_composition_is_linear_in_devices_and_nodes():
  from perfmodel import calibrate_nodes as cn
  coef = {"a": 1.3, "b": 2e-6, "c": 1e-4, "e": 1e-10, "f": 5e-6}
  f1 = [0.01, 400, 1, 0.0, 0]
  f2 = [0.02, 800, 2, 1e6, 4]
  assert cn.compose(coef, f1) == pytest.approx(1.3 * 0.01 + 2e-6 * 400 + 1e-4)
  assert cn.compose(coef, f2) == pytest.approx(2 * cn.compose(coef, f1) + 1e-10 * 1e6 + 5e-6 * 4)
  # the fit recovers known coefficients from exact data
  import numpy as np
  rng = np.random.default_rng(0)
  rows = [[rng.uniform(1e-3, 1), rng.integers(100, 5000), n, rng.uniform(0, 1e7) * (n > 1), 20 * (n > 1)]
          for n in (1, 1, 1, 2, 4, 1, 2, 8, 1, 4)]
  y = [cn.compose(coef, r) for r in rows]
  got = cn._coef(cn._nnls(rows, y))  # noqa: SLF001
  for k in ("a", "b", "c"):
    assert got[k] == pytest.approx(coef[k], rel=1e-3)


def test_pow2_tokens_counts_tokens_per_device():
  from perfmodel import calibrate_nodes as cn, suite
  cfg = lambda **kw: cn._cfg({"name": "x", **kw})  # noqa: E731,SLF001
  assert cn.pow2_tokens(cfg())  # BASE: 8 x 64 = 512 tokens
  assert not cn.pow2_tokens(cfg(data=dict(seq_len=48)))  # 384
  assert cn.pow2_tokens(cfg(mesh=dict(data=2)))  # 256 per device
  assert not cn.pow2_tokens(cfg(data=dict(global_batch=6), mesh=dict(data=2)))  # 192 per device
  # every validation config is a power-of-two step; calibration has both kinds, so the fit can tell them apart
  assert all(cn.pow2_tokens(cn._cfg(e)) for e in suite.SUITE)  # noqa: SLF001
  kinds = {cn.pow2_tokens(cn._cfg(e)) for e in suite.CALIBRATION if "mesh" not in e}  # noqa: SLF001
  assert kinds == {True, False}


def test_train_fit_learns_the_power_of_two_scale_and_old_coefficients_ignore_it():
  from perfmodel import calibrate_nodes as cn
  import numpy as np
  rng = np.random.default_rng(1)
  rows, y = [], []
  for i in range(12):
    a, pow2 = rng.uniform(1e-3, 0.1), i % 3 == 0
    rows.append([a, rng.integers(100, 5000), 1, 0.0, 0, 0.0, 0.0, 0.0, a if pow2 else 0.0])
    y.append(1.1 * a + 1e-4 + (0.25 * a if pow2 else 0.0))
  coef = cn.fit_typed(rows, y, ["train"] * len(rows))["train"]
  assert coef["a"] == pytest.approx(1.1, rel=1e-3) and coef["p"] == pytest.approx(0.25, rel=1e-2)
  # a composition fitted before the term existed has no "p": the feature changes nothing for it
  assert cn.compose({"train": {"a": 1.1, "c": 1e-4}}, rows[0], "train") == pytest.approx(1.1 * rows[0][0] + 1e-4)


def test_multi_device_steps_borrow_the_training_power_of_two_term_only_without_their_own():
  """The calibration's multi-device programs are no power-of-two steps: the multi type takes the training type's p
  (a power-of-two multi-device step is priced with it, another is not), and leaves its own fit alone."""
  from perfmodel import calibrate_nodes as cn
  import numpy as np
  rng = np.random.default_rng(2)
  rows, y, types = [], [], []
  for i in range(12):  # single-device steps, a third of them power-of-two
    a, pow2 = rng.uniform(1e-3, 0.1), i % 3 == 0
    rows.append([a, 1000, 1, 0.0, 0, 0.0, 0.0, 0.0, a if pow2 else 0.0])
    y.append(1.1 * a + (0.25 * a if pow2 else 0.0))
    types.append("train")
  for _ in range(6):  # two-device steps, none power-of-two
    a, coll = rng.uniform(1e-3, 0.1), rng.uniform(1e-4, 1e-2)
    rows.append([a, 1000, 2, coll, 4, 0.0, 0.0, 0.0, 0.0])
    y.append(1.3 * a + 2.0 * coll)
    types.append("multi")
  coef = cn.fit_typed(rows, y, types)
  assert coef["multi"]["a"] == pytest.approx(1.3, rel=1e-3) and coef["multi"]["e"] == pytest.approx(2.0, rel=1e-3)
  assert coef["multi"]["p"] == pytest.approx(coef["train"]["p"]) == pytest.approx(0.25, rel=1e-2)
  f = [0.05, 1000, 2, 1e-3, 4, 0.0, 0.0, 0.0]
  plain, pow2 = cn.compose(coef, f + [0.0], "multi"), cn.compose(coef, f + [0.05], "multi")
  assert pow2 - plain == pytest.approx(0.25 * 0.05, rel=1e-2)


def test_pin_regime_sets_single_core_and_single_threaded_xla(monkeypatch):
  import os
  from perfmodel import bench
  monkeypatch.setenv("XLA_FLAGS", "")
  before = os.sched_getaffinity(0)
  try:
    core = bench.pin()
    assert os.sched_getaffinity(0) == {core} and bench.pinned()
    assert "--xla_cpu_multi_thread_eigen=false" in os.environ["XLA_FLAGS"]
    assert bench.regime()["pinned_core"] == core
  finally:
    for tid in bench._thread_ids():  # noqa: SLF001 (undo for every thread pin() touched)
      try:
        os.sched_setaffinity(tid, before)
      except OSError:
        pass
    os.sched_setaffinity(0, before)


def test_fresh_temp_buffer_feature_only_above_the_mmap_threshold():
  """A step whose temp buffer exceeds glibc's 32 MiB mmap threshold page-faults it afresh every step."""
  from perfmodel import calibrate_nodes as cn
  from perfmodel.graph import ExecGraph, Region
  g = ExecGraph(regions={"main": Region(name="main", nodes=[])}, entry="main", n_devices=2)
  small = cn.composition_features(g, lambda n: 0.0, 2, temp_bytes=cn.FRESH_ALLOC_THRESHOLD)
  big = cn.composition_features(g, lambda n: 0.0, 2, temp_bytes=cn.FRESH_ALLOC_THRESHOLD + 4096)
  assert small[5] == 0.0 and big[5] == 2 * (cn.FRESH_ALLOC_THRESHOLD + 4096)
  assert cn.compose({"train": {"a": 1.0, "g": 1e-9}}, big, "train") == pytest.approx(1e-9 * big[5])
  # with malloc keeping freed blocks (framework/host_memory.py) nothing is faulted afresh: explicitly, or
  # because the profile says its step times were calibrated that way
  assert cn.composition_features(g, lambda n: 0.0, 2, temp_bytes=2 ** 30, keeps=True)[5] == 0.0
  kept = type("Hw", (), {"calibration": {"regime": {"host_malloc": "keep_freed"}}})()
  assert cn.allocator_keeps(kept) and not cn.allocator_keeps(None)
  assert cn.composition_features(g, lambda n: 0.0, 2, temp_bytes=2 ** 30, hw=kept)[5] == 0.0
  # the decode loop body of a sampler allocates nothing per token
  assert 5 in cn.TYPE_FEATURES["train"] and 5 not in cn.TYPE_FEATURES["decode"]


def test_decode_fit_takes_a_signed_per_thunk_term_and_training_stays_non_negative():
  """Rows built from a known law with a negative per-thunk term (traced node times that each carry a fixed
  tracing cost): the decode type recovers it; the training type, whose terms are all non-negative, cannot."""
  from perfmodel import calibrate_nodes as cn
  rng = np.random.default_rng(0)
  rows, y = [], []
  for _ in range(8):
    execs = float(rng.integers(50, 800))
    node_sum = execs * float(rng.uniform(1e-6, 8e-6))
    nbytes = float(rng.uniform(1e5, 3e6))
    rows.append([node_sum, execs, 0.0, 0.0, 0.0, 0.0, nbytes])
    y.append(0.5 * node_sum - 0.4e-6 * execs + 2e-11 * nbytes)
  coef = cn.fit_typed(rows, y, ["decode"] * len(rows))["decode"]
  assert coef["b"] == pytest.approx(-0.4e-6, rel=0.05) and coef["a"] == pytest.approx(0.5, rel=0.05)
  for r, t in zip(rows, y):
    assert cn.compose({"decode": coef}, r, "decode") == pytest.approx(t, rel=0.02)
  train = cn.fit_typed(rows, y, ["train"] * len(rows))["train"]
  assert min(train.values()) >= 0.0


def test_speed_normalisation_pools_neighbouring_probes_and_scales_to_the_reference():
  from perfmodel import rounds, speed
  assert speed.normalise(2.0, 0.05, 0.04) == pytest.approx(1.6)
  assert speed.normalise(2.0, None, 0.04) == 2.0 and speed.normalise(2.0, 0.05, None) == 2.0
  # a host 25% slower than at calibration, plus one outlier probe: the outlier does not move its row
  rows = [{"measured_s": 1.25, "predicted_s": 1.0, "probe_s": 0.05} for _ in range(9)]
  rows[4]["probe_s"] = 0.09
  assert rounds.speed_normalise(rows, ref=0.04)
  for r in rows:
    assert r["measured_at_ref_s"] == pytest.approx(1.0) and r["err_at_ref_pct"] == pytest.approx(0.0, abs=1e-9)
  rows[0].pop("probe_s")
  assert not rounds.speed_normalise(rows, ref=0.04)  # a row without a probe: no normalised figure


def test_validate_rounds_pool_to_the_median_and_each_round_is_normalised_with_its_own_probes(tmp_path):
  """Two rounds of the same suite: the second ran with the host 1.5x slower. Each round scaled by its own probes
  gives the same reference-speed time, so the pooled error at the reference speed is the model's alone; the raw
  measurement is the median over rounds and the noise shows the spread between them."""
  import json
  from perfmodel import rounds as R
  r1 = {n: {"measured_s": t, "noise_pct": 2.0, "probe_s": 0.04, "host_devices": 1} for n, t in (("a", 1.0), ("b", 2.0))}
  r2 = {n: {"measured_s": 1.5 * m["measured_s"], "noise_pct": 3.0, "probe_s": 0.06, "host_devices": 1}
        for n, m in r1.items()}
  old, new = tmp_path / "old.json", tmp_path / "new.json"
  old.write_text(json.dumps(r1))  # a file written before rounds existed is one round
  new.write_text(json.dumps({"rounds": [r2]}))
  rounds = R.load_rounds(str(old)) + R.load_rounds(str(new))
  assert len(rounds) == 2 and rounds[0]["a"]["measured_s"] == 1.0
  pooled = {n: R.pool_rounds([c[n] for c in rounds]) for n in ("a", "b")}
  assert pooled["a"]["measured_s"] == pytest.approx(1.25)  # median of two = their mean
  assert pooled["a"]["round_spread_pct"] == pytest.approx(40.0) and pooled["a"]["noise_pct"] == pytest.approx(20.0)
  rows = [dict(name=n, predicted_s=1.1 * r1[n]["measured_s"], rounds=pooled[n]["rounds"]) for n in ("a", "b")]
  assert R.normalise_rounds(rows, ref=0.04)
  for r in rows:
    assert [x["measured_at_ref_s"] for x in r["rounds"]] == pytest.approx([r["predicted_s"] / 1.1] * 2)
    assert r["err_at_ref_pct"] == pytest.approx(10.0)
  # a round without probe times: no normalised figure
  rows[0]["rounds"][1]["probe_s"] = None
  assert not R.normalise_rounds(rows, ref=0.04)


def test_decode_bytes_are_priced_piecewise_and_the_knee_is_recovered_by_leave_one_out():
  """Decode time per byte rises once the step's bytes leave the core's cache: h per byte below the knee,
  i per byte above; the fit picks the knee from its grid by leave-one-out over the decode rows alone."""
  from perfmodel import calibrate_nodes as cn
  knee = cn.KNEES[3]
  true = {"h": 2.5e-11, "i": 5e-11, "knee": knee}
  rows = [[1e-4, 120, 0.0, 0.0, 0, 0.0, b] for b in (0.4 * knee, 0.8 * knee, 1.5 * knee, 3 * knee, 6 * knee, 11 * knee)]
  y = [cn.compose(true, r) for r in rows]
  assert y[0] == pytest.approx(2.5e-11 * 0.4 * knee) and y[-1] == pytest.approx(2.5e-11 * knee + 5e-11 * 10 * knee)
  coef = cn.fit_typed(rows, y, ["decode"] * len(rows))["decode"]
  assert coef["knee"] == knee
  assert coef["h"] == pytest.approx(2.5e-11, rel=1e-3) and coef["i"] == pytest.approx(5e-11, rel=1e-3)
  # a profile fitted before the split (no knee) prices all bytes by h, as it did
  assert cn.compose({"decode": {"h": 3e-11}}, rows[-1], "decode") == pytest.approx(3e-11 * rows[-1][6])


def test_time_slope_measures_the_per_unit_cost_without_the_program_switch_penalty():
  """TPOT = slope over two generation lengths. The first call after switching programs pays extra (cold caches:
  1.3-2.2 ms on decode_b4); time_slope's blocks drop it, so the slope is the steady-state per-unit cost."""
  import time
  from perfmodel import bench
  state = {"last": None}

  def spin(seconds):
    c = time.process_time()
    while time.process_time() - c < seconds:
      pass

  def make(units):
    def fn():
      if state["last"] != units:  # a switch: 4 ms penalty, larger than the 2 ms slope itself
        spin(4e-3)
      state["last"] = units
      spin(units * 0.5e-3)
      return units
    return fn

  r = bench.time_slope(make(2), make(6), 2, 6, reps=3, block=3)
  assert r["cpu"]["n"] == 3 and r["clock"] == "wall"
  assert bench.view(r, "cpu")["median"] == pytest.approx(0.5e-3, rel=0.2)


def test_validate_measures_each_entry_in_a_child_with_exactly_its_device_count(tmp_path):
  """Idle virtual devices slow a one-device step 1.23-1.45x, so validate (and calibrate) measure an entry in a
  child process with exactly the devices experiments.run would give its mesh."""
  from perfmodel import validate
  suite = tmp_path / "suite.py"
  suite.write_text(
      "BASE = dict(model=dict(vocab_size=256, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32,\n"
      "                       max_seq_len=32), data=dict(seq_len=8, global_batch=4), mesh=dict(data=1),\n"
      "            train=dict(steps=2))\n"
      "SUITE = [dict(name='dp2', mesh=dict(data=2))]\n")
  got = validate.measure_isolated(str(suite), ["dp2"], 2, reps=2, probe=False)
  assert got["dp2"]["devices_seen"] == 2 and got["dp2"]["host_devices"] == 2
  assert got["dp2"]["measured_s"] > 0 and got["dp2"]["regime"]["host_malloc"] == "keep_freed"
  # both readings of the step (tests/perfmodel/test_step_statistic.py): the p10 one never above the median
  assert 0 < got["dp2"]["p10"]["measured_s"] <= got["dp2"]["measured_s"]


def test_speed_normalisation_scales_each_device_count_by_its_own_reference():
  from perfmodel import rounds
  # probes timed in a 4-device child are 1.3x slower than in the 1-device child at the same host speed
  rows = ([{"measured_s": 1.0, "predicted_s": 1.0, "probe_s": 0.04, "host_devices": 1} for _ in range(3)] +
          [{"measured_s": 2.0, "predicted_s": 2.0, "probe_s": 0.052, "host_devices": 4} for _ in range(3)])
  assert rounds.speed_normalise(rows, ref=0.04, refs_by_devices={"1": 0.04, "4": 0.052})
  for r in rows:
    assert r["err_at_ref_pct"] == pytest.approx(0.0, abs=1e-9)


def test_device_references_see_a_child_that_ran_in_a_slow_window():
  from perfmodel import speed
  # the probe is 1.2x slower with 4 virtual devices; the 4-device child also ran while the host was 1.4x slower,
  # which its one-device bracketing probes (fresh processes, 5% faster than in a measuring child) show
  probes = {1: [0.040, 0.041, 0.039], 4: [0.040 * 1.2 * 1.4] * 3}
  windows = {1: [0.038, 0.038], 4: [0.038 * 1.4, 0.038 * 1.4]}
  refs = speed.device_references(0.040, probes, windows)
  assert refs[1] == 0.040
  assert refs[4] == pytest.approx(0.040 * 1.2, rel=1e-9)  # the device factor only, not the slow window
  # a 4-device step measured in that window, normalised with this reference, is at the reference speed
  assert speed.normalise(1.4, probes[4][0], refs[4]) == pytest.approx(1.0, rel=1e-9)
  # without windows (step times from before this change): the child's own median, as before
  assert speed.device_references(0.040, probes, {})[4] == pytest.approx(0.040 * 1.2 * 1.4)


def test_calibration_gate_keeps_the_previous_profile_when_leave_one_out_is_too_high(tmp_path):
  """A fresh calibration above the leave-one-out threshold is moved aside and the previous files come back byte
  for byte; one at or under it stays. A profile that did not exist before is moved aside, not left half-made."""
  from perfmodel import calibrate
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


def test_calibration_step_rounds_pool_to_the_median_at_one_reference_speed():
  from perfmodel import calibrate

  def rnd(probe, steps, noise=4.0):
    # one round of calibrate._step_times_child: every program with its child's probe and bracketing window
    return {name: {"measured_s": s, "noise_pct": noise, "probe_s": probe * (1.3 if n > 1 else 1.0),
                   "host_devices": n, "window_probe_1dev_s": [probe, probe]}
            for name, (n, s) in steps.items()}
  steps = {"a": (1, 0.010), "m": (2, 0.020)}
  # round 2 ran on a host 2x slower (its probes too); round 3 had an outlier on the multi-device program
  rounds = [rnd(0.030, steps), rnd(0.060, {"a": (1, 0.020), "m": (2, 0.040)}),
            rnd(0.030, {"a": (1, 0.010), "m": (2, 0.013)})]
  out, ref, refs, windows = calibrate.pool_step_rounds(rounds)
  assert ref == pytest.approx(0.030)  # median of all one-device probes
  assert refs[1] == pytest.approx(0.030) and refs[2] == pytest.approx(0.030 * 1.3)
  assert out["a"]["measured_s"] == pytest.approx(0.010)  # the slow round is normalised, not averaged in raw
  assert out["m"]["measured_s"] == pytest.approx(0.020)  # the outlier round is outvoted
  assert out["m"]["rounds"] == pytest.approx([0.020, 0.020, 0.013])
  assert out["m"]["noise_pct"] == pytest.approx(100 * (0.020 - 0.013) / 0.020 / 2)
  assert out["a"]["noise_pct"] == pytest.approx(4.0) and out["a"]["measured_raw_s"] == pytest.approx(0.010)
  # one round: its measurement as it was, at its own reference (the behaviour before rounds)
  one, ref1, _, _ = calibrate.pool_step_rounds([rnd(0.030, steps)])
  assert ref1 == pytest.approx(0.030) and one["m"]["measured_s"] == pytest.approx(0.020)


def test_node_samples_pool_to_the_median_over_trace_children():
  from perfmodel import calibrate
  def child(scale, extra=False):
    ss = [{"prog": "p", "name": "dot.1", "cls": "dot", "fp": "a", "t": 1.0 * scale, "t50": 1.5 * scale, "tm": 2.0 * scale},
          {"prog": "p", "name": "fusion.2", "cls": "fusion:kLoop", "fp": "b", "t": 4.0 * scale, "t50": 5.0 * scale}]
    if extra:
      ss.append({"prog": "p", "name": "copy.3", "cls": "copy", "fp": "c", "t": 9.0, "t50": 9.0, "tm": 9.0})
    return {"p": ss, "q": [dict(ss[0], prog="q")]}
  # the middle child is 1.45x slow throughout (a process offset): the median child wins, not the mean
  out = calibrate.pool_traced([child(1.0), child(1.45, extra=True), child(1.1)])
  by = {s["name"]: s for s in out["p"]}
  assert by["dot.1"]["t"] == pytest.approx(1.1) and by["dot.1"]["t50"] == pytest.approx(1.65)
  assert by["dot.1"]["tm"] == pytest.approx(2.2) and by["dot.1"]["children"] == 3
  assert "tm" not in by["fusion.2"] and by["fusion.2"]["t"] == pytest.approx(4.4)  # a missing statistic stays missing
  assert by["copy.3"]["t"] == 9.0 and by["copy.3"]["children"] == 1  # timed by one child only: kept as it was
  assert [s["name"] for s in out["q"]] == ["dot.1"] and out["q"][0]["t"] == pytest.approx(1.1)
  # one child: its samples unchanged
  one = calibrate.pool_traced([child(1.3)])
  assert one["p"][0]["t"] == pytest.approx(1.3) and one["p"][1]["t50"] == pytest.approx(6.5)
