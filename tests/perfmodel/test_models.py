"""Closed forms: collectives (alpha-beta), pipeline bubbles (formula == simulation), the timeline, profiles, the
learned backend."""
import json
import os

import pytest

from parallelism import pipeline as pp_lib
from perfmodel import hardware, pipeline, timeline
from perfmodel.cost import collectives as C
from perfmodel.cost import learned
from perfmodel.cost.chain import Chain
from perfmodel.cost.physical import Calibrated, Roofline
from perfmodel.graph.nodes import CollectiveInfo, ExecGraph, Node, Region
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
def test_the_schedule_tables_give_the_textbook_pipeline_time_for_equal_stages(p, m, schedule_name):
  f, b = 1.0, 2.0
  pc = pipeline.cost(schedule_name, p, m, f, b)
  assert pc.step_time == pytest.approx((m + p - 1) * (f + b))
  assert pc.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
  assert pipeline.cost(schedule_name, p, m, f, b, c=0.5).step_time == pytest.approx(pc.step_time + 2 * (p - 1) * 0.5)


def test_a_slower_stage_sets_every_tick_it_works_in():
  s = pp_lib.make_schedule("1f1b", 4, 8)
  equal = pipeline.tick_time(s, [1.0] * 4, [2.0] * 4)
  slow = pipeline.tick_time(s, [1.0, 1.0, 1.0, 2.0], [2.0, 2.0, 2.0, 4.0])
  assert equal == pytest.approx(11 * 3.0) and slow > equal
  assert pipeline.cost("gpipe", 1, 8, 1.0, 2.0).step_time == 24.0  # one stage: no bubble


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
  hw = hardware.load("cpu")
  path = tmp_path / "old.json"
  path.write_text(json.dumps({"meta": {}, "samples": []}))  # no version field: version 1
  with pytest.raises(ValueError, match="features version 1.*perfmodel calibrate"):
    learned.Learned(hw, path=str(path))


def test_scheduler_places_compute_and_collectives_on_two_streams_and_records_segments():
  """The one placement engine: a sync collective blocks both streams, an async one only the comm stream until its
  wait, compute in flight with a transfer is slowed by the overlap term; recorded compute merges by segment."""
  s = timeline.Scheduler(overlap_slowdown=0.5, record=True)
  assert s.compute(1.0, key="a", name="compute fwd", segment="fwd", args={"phase": "fwd", "nodes": 0}) == 1.0
  s.compute(2.0, ready=s.ready(["a"]), key="b", segment="fwd", name="compute fwd")
  assert s.makespan == 3.0 and len(s.events) == 1 and s.events[0].dur == 3.0 and s.events[0].args["nodes"] == 2
  assert s.collective(4.0, is_async=True, key="ar") == 3.0  # starts when its inputs exist, compute continues
  assert s.compute(1.0, segment="bwd", name="compute bwd") == 1.5  # slowed: a transfer is in flight
  s.wait("ar", key="w")
  assert s.t_comp == 7.0 and s.exposed == pytest.approx(7.0 - 4.5)
  s.collective(2.0, name="sync")
  assert s.makespan == 9.0 and [e.cat for e in s.events] == ["compute", "comm", "compute", "comm"]
  s.block(1.0, name="wait (peers)")
  assert s.events[-1].start == 9.0 and s.makespan == 10.0


def test_waits_shift_what_follows_and_ranks_align_at_their_synchronising_events():
  E = timeline.Event
  a = [E("c", "compute", 0.0, 2.0), E("p2p", "comm", 2.0, 1.0), E("c", "compute", 3.0, 1.0)]
  b = [E("c", "compute", 0.0, 5.0), E("p2p", "comm", 5.0, 1.0), E("c", "compute", 6.0, 2.0)]
  out = timeline.insert_waits(a, [(1, 0.5, "wait", None), (3, 0.25, "tail", {"x": 1})])
  assert [(e.name, e.start) for e in out] == [("c", 0.0), ("wait", 2.0), ("p2p", 2.5), ("c", 3.5), ("tail", 4.5)]
  aligned = timeline.align({"a": a, "b": b}, {"a": [a[1]], "b": [b[1]]})
  assert [(e.name, e.start, e.dur) for e in aligned["a"]] == [("c", 0.0, 2.0), ("wait (peer stages)", 2.0, 3.0),
                                                             ("p2p", 5.0, 1.0), ("c", 6.0, 1.0)]
  assert aligned["b"] == b  # the last to arrive waits for nobody


def test_a_profile_may_carry_efficiency_curves_kept_as_written_with_their_sources():
  d = json.loads(open(os.path.join(hardware.PROFILE_DIR, "h100.json")).read())
  d["efficiency"] = {"matmul": {"value": [[1e9, 0.3], [1e12, 0.7]], "source": "vendor table", "dtype": "bf16"},
                     "collectives": {"all-gather": {"value": [[1e6, 1e10]], "unit": "busbw", "source": "nccl-tests"}}}
  hw = hardware.from_dict(d)
  assert hw.efficiency == d["efficiency"]
  assert hw.sources["efficiency.matmul"] == "vendor table"
  assert hw.sources["efficiency.collectives.all-gather"] == "nccl-tests"
  # every published curve of the committed profiles names its source
  for name in ("a100", "h100", "h200", "tpu_v5e", "tpu_v5p", "tpu_v6e"):
    prof = hardware.load(name)
    assert all(prof.sources[k] for k in prof.sources if k.startswith("efficiency.")), name
