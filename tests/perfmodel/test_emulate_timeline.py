"""Emulation timeline: runtime branches counted per stage, collective combining, permute receivers, gloo hook."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from framework import config as config_lib
from framework import config_file
from perfmodel import hardware
from perfmodel.cost import collectives
from perfmodel.emulate import gloo_calibration, measure, rank_program
from perfmodel.emulate import timeline as tl_lib
from perfmodel.emulate.topology import RankSpace


def _cfg(spec, over, n):
  return config_lib.validate(config_file.load(spec, over), n)


def test_pipeline_branches_are_counted_per_stage_and_idle_slots_cost_nothing():
  """GPipe P=2, M=2 with fsdp=2 x tensor=2: 6 ticks; a stage runs its forward and backward slot
  M=2 times each. The timeline must walk exactly the branches that ran, so FSDP all-gathers inside
  the slots are charged per executed slot, not per tick (the old upper bound)."""
  cfg = _cfg("experiments/configs/llama3_70b.py:runlocal=True", ["--config.mesh.schedule=gpipe"], 8)
  prog = rank_program.build(cfg)
  hw = hardware.load("h100")
  sched_ticks = 2 * (cfg.mesh.microbatches + cfg.mesh.pipeline - 1)
  for stage in (0,):  # one stage keeps the test short; the benchmark composes both
    rank = prog.space.rank({"pipeline": stage})
    run = measure.run_rank(prog, rank, repeats=1, warmup=0, host_data=False)
    per_tick = {k: v for k, v in run.branch_trace.items() if len(v) == sched_ticks}
    # the forward-slot and backward-slot conds run every tick and take their work branch M times
    assert len(per_tick) >= 2
    assert sorted(sum(v) for v in per_tick.values())[-2:] == [cfg.mesh.microbatches] * 2
    traced = tl_lib.rank_timeline(rank, run.hlo_text, run.records, run.compute_s, prog.space, hw, hw,
                                  branch_trace=run.branch_trace)
    bound = tl_lib.rank_timeline(rank, run.hlo_text, run.records, run.compute_s, prog.space, hw, hw,
                                 branch_trace=None)
    assert traced.untraced_branches == 0 and bound.untraced_branches > 0
    walked = {int(k): sum(c for c in v.values()) for k, v in traced.branches.items()}
    for site, seq in run.branch_trace.items():  # every execution of every compiled conditional was walked
      if site in walked:
        assert walked[site] == len(seq)
    assert traced.comm_s < bound.comm_s  # idle ticks do not pay the slot's all-gathers
    assert abs(traced.compute_s - run.compute_s) / run.compute_s < 0.35  # measured time kept (minus stand-ins)


def test_data_parallel_collectives_combine_like_the_real_compiled_program():
  """XLA combines the 13 gradient psums and the loss psum of the DP step into one all-reduce; the
  emulated timeline must issue as many calls per step as the real 2-device program executes."""
  from parallelism import shard_map_step
  from parallelism.mesh import make_mesh
  from perfmodel.graph import from_hlo as graph_lib
  cfg = _cfg("experiments/configs/emulate_validate.py:layout=data,runlocal=True", [], 2)
  real = shard_map_step.build(cfg, make_mesh(cfg.mesh, jax.devices()[:2]))
  g = graph_lib.from_hlo_text(real.lower().compile().as_text(), 2)
  real_calls = sum(k for n, k in g.walk() if n.kind in ("collective", "p2p"))
  prog = rank_program.build(cfg)
  run = measure.run_rank(prog, 0, execute=False)  # compile only: placement does not need timings
  hw = hardware.load("h100")
  tl = tl_lib.rank_timeline(0, run.hlo_text, run.records, 0.0, prog.space, hw, hw, compute_hw=hw)
  apart = tl_lib.rank_timeline(0, run.hlo_text, run.records, 0.0, prog.space, hw, hw, combine=False, compute_hw=hw)
  assert len(run.records) > 1 and tl.collective_calls == real_calls == 1
  assert apart.collective_calls == len(run.records)


def test_permute_receiver_takes_part_and_gloo_curves_hook_into_the_collective_model(tmp_path):
  from perfmodel.emulate.standins import CollectiveRecord
  space = RankSpace.of({"pipeline": 2})
  fwd = CollectiveRecord(0, "collective-permute", "ppermute", ("pipeline",), 2, 1024.0, (256,), "float32", 1, "",
                         perm=((0, 1),))
  assert fwd.group(space, 0) == (0, 1) and fwd.group(space, 1) == (0, 1)  # sender and receiver both pay
  path = tmp_path / "gloo.json"
  curves = {k: [[1024.0, 1e-3], [1048576.0, 4e-3]] for k in gloo_calibration.KINDS}
  path.write_text(json.dumps({"curves": curves, "source": "test"}))
  hw, cal = gloo_calibration.with_gloo_curves(hardware.load("cpu"), str(path))
  assert cal["source"] == "test"
  c = collectives.cost("collective-permute", 1024.0, (0, 1), hw)
  assert c.algorithm == "measured" and np.isclose(c.seconds, 1e-3)
  s, _ = tl_lib.collective_seconds(fwd, space, 1, hw)
  assert s > 0


def test_straggler_wait_is_the_median_max_over_ranks_and_lands_before_the_last_collective():
  xs = [1.0, 2.0, 3.0, 4.0]
  assert tl_lib.median_max(xs, 1) == np.median(xs)  # one rank waits for nobody
  # two ranks: the max is below x with probability F(x)^2, so its median is the 1/sqrt(2) quantile
  assert np.isclose(tl_lib.median_max(xs, 2), 3.0 + (0.5 ** 0.5 * 3 - 2))
  rng = np.random.default_rng(0)
  big = rng.standard_normal(20001)
  draws = rng.choice(big, size=(4001, 8)).max(axis=1)
  assert abs(tl_lib.median_max(big, 8) - np.median(draws)) < 0.05  # agrees with sampling
  assert np.isclose(tl_lib.median_max(xs, 8192), 4.0, atol=1e-3)
  # a single stalled step does not move it, as it does not move a median step time
  assert tl_lib.median_max([1.0] * 9 + [10.0], 2) < 1.5
  ev = [tl_lib.Event("fwd", "compute", 0.0, 1.0), tl_lib.Event("all-reduce", "comm", 1.0, 0.5),
        tl_lib.Event("opt", "compute", 1.5, 0.2), tl_lib.Event("all-reduce", "comm", 1.7, 0.3)]
  tl = tl_lib.RankTimeline(rank=0, events=ev, compute_s=1.2, standin_local_s=0.0, comm_s=0.8)
  out = tl_lib.add_straggler_wait(tl, 0.25)
  assert out.iteration_s == tl.iteration_s + 0.25 and out.wait_s == 0.25
  waits = [e for e in out.events if e.cat == "wait"]
  assert len(waits) == 1 and waits[0].start == 1.7
  assert [e.start for e in out.events if e.name == "opt"] == [1.5]  # events before it do not move


def test_per_call_waits_land_before_symmetric_calls_only_and_shift_what_follows():
  """A replayed call among ranks of one class gets the measured wait for the later peer in front of it; a call
  over a structural (pipeline) axis does not (compose aligns those); an unmeasured call gets none."""
  def comm(name, start, dur, axes, sizes):
    return tl_lib.Event(name, "comm", start, dur, {"kind": "all-reduce", "axes": axes, "sizes": sizes})
  ev = [tl_lib.Event("fwd", "compute", 0.0, 1.0), comm("ar tensor", 1.0, 0.1, ["tensor"], [8.0]),
        tl_lib.Event("bwd", "compute", 1.1, 1.0), comm("ar pipeline", 2.1, 0.1, ["pipeline"], [8.0]),
        comm("ar tensor 2", 2.2, 0.1, ["tensor"], [8.0, 8.0]), comm("ar unmeasured", 2.3, 0.1, ["tensor"], [4.0])]
  tl = tl_lib.RankTimeline(rank=0, events=ev, compute_s=2.0, standin_local_s=0.0, comm_s=0.4)
  waits = {collectives.call_key("all-reduce", [8.0]): 0.01, collectives.call_key("all-reduce", [8.0, 8.0]): 0.02}
  out, added = tl_lib.add_call_waits(tl, waits, ("pipeline",))
  assert added == pytest.approx(0.03) and out.wait_s == pytest.approx(0.03)
  assert out.iteration_s == pytest.approx(tl.iteration_s + 0.03)
  w = [e for e in out.events if e.cat == "wait"]
  assert [(e.args["call"], round(e.start, 6), e.dur) for e in w] == [("ar tensor", 1.0, 0.01), ("ar tensor 2", 2.21, 0.02)]
  start = {e.name: e.start for e in out.events if e.cat != "wait"}
  assert start["fwd"] == 0.0 and start["ar tensor"] == pytest.approx(1.01)
  assert start["ar pipeline"] == pytest.approx(2.11) and start["ar unmeasured"] == pytest.approx(2.33)
  assert tl_lib.add_call_waits(tl, {}, ())[1] == 0.0  # nothing measured: the timeline as it was


def _gloo_hw(tmp_path, first=1e-3, nxt=None):
  path = tmp_path / "gloo.json"
  curves = {k: [[1024.0, first], [1048576.0, 4 * first]] for k in gloo_calibration.KINDS}
  data = {"curves": curves, "source": "test"}
  if nxt is not None:
    data["next_curves"] = {k: [[1024.0, nxt], [1048576.0, 4 * nxt]] for k in gloo_calibration.KINDS}
  path.write_text(json.dumps(data))
  return gloo_calibration.with_gloo_curves(hardware.load("cpu"), str(path))[0]


def test_combined_call_prices_each_buffer_on_cpu_and_one_launch_elsewhere(tmp_path):
  """XLA:CPU loops a tuple collective over its buffers (one gloo call each); NCCL groups them."""
  sizes = [1024.0, 1048576.0, 1048576.0]
  lone = _gloo_hw(tmp_path)
  # no further-buffer curve: every buffer priced as a lone call
  c = collectives.combined_cost("all-reduce", sizes, (0, 1), lone)
  assert np.isclose(c.seconds, 1e-3 + 4e-3 + 4e-3)
  with_next = _gloo_hw(tmp_path, nxt=0.5e-3)
  c = collectives.combined_cost("all-reduce", sizes, (0, 1), with_next)
  assert c.algorithm == "measured-combined" and np.isclose(c.seconds, 1e-3 + 2e-3 + 2e-3)
  # a group of 4 scales the further buffers like the first (ring all-reduce factor 2(n-1)/n = 1.5)
  c4 = collectives.combined_cost("all-reduce", sizes, (0, 1, 2, 3), with_next)
  assert np.isclose(c4.seconds, 1.5 * c.seconds)
  # a call measured as such wins, for its own sizes and a 2-rank group only
  key = collectives.call_key("all-reduce", sizes)
  hw = dataclasses.replace(with_next, collective_calls={key: 7e-3})
  assert collectives.combined_cost("all-reduce", sizes, (0, 1), hw).seconds == 7e-3
  assert collectives.combined_cost("all-reduce", sizes, (0, 1, 2, 3), hw).seconds == c4.seconds
  assert collectives.combined_cost("all-reduce", sizes[:2], (0, 1), hw).seconds != 7e-3
  gpu = hardware.load("h100")
  merged = collectives.combined_cost("all-reduce", sizes, tuple(range(8)), gpu)
  assert np.isclose(merged.seconds, collectives.cost("all-reduce", sum(sizes), tuple(range(8)), gpu).seconds)


def test_multi_operand_psum_is_recorded_per_buffer_and_replay_calls_are_distinct(tmp_path):
  from perfmodel.emulate import emulator
  cfg = _cfg("experiments/configs/emulate_validate.py:layout=data,runlocal=True", [], 2)
  prog = rank_program.build(cfg)
  run = measure.run_rank(prog, 0, execute=False)
  assert all(sum(r.sizes()) == r.bytes for r in run.records)
  hw = _gloo_hw(tmp_path, nxt=0.5e-3)
  tl = tl_lib.rank_timeline(0, run.hlo_text, run.records, 0.0, prog.space, hw, hw, compute_hw=hw)
  comm = [e for e in tl.events if e.cat == "comm"]
  assert len(comm) == 1  # the gradient psums + loss psum: one combined call
  sizes = comm[0].args["sizes"]
  assert len(sizes) == sum(len(r.sizes()) for r in run.records) and comm[0].args["compute_before_s"] > 0
  calls = emulator._calls_to_replay([tl, tl])
  assert calls == [{"kind": "all-reduce", "sizes": sizes, "burst_s": comm[0].args["compute_before_s"]}]
  replayed = dataclasses.replace(hw, collective_calls={collectives.call_key("all-reduce", sizes): 0.123})
  tl2 = tl_lib.rank_timeline(0, run.hlo_text, run.records, 0.0, prog.space, replayed, hw, compute_hw=hw)
  assert np.isclose(tl2.comm_s, 0.123 + hw.launch_overhead)


@pytest.mark.multiprocess
def test_replay_times_the_programs_own_calls_between_two_gloo_processes():
  from perfmodel.emulate import localrun
  if len(localrun.cores()) < 2:
    pytest.skip("replay needs 2 cores")
  calls = [{"kind": "all-reduce", "sizes": [4096.0, 4.0], "burst_s": 0.002},
           {"kind": "collective-permute", "sizes": [65536.0], "burst_s": 0.002}]
  table, both = gloo_calibration.replay(calls, reps=3, timeout_s=300, per_process=True)
  assert set(table) == set(both) == {collectives.call_key(c["kind"], c["sizes"]) for c in calls}
  assert all(0 < s < 1.0 for s in table.values())
  assert all(len(ts) == 2 and table[k] == min(ts) for k, ts in both.items())  # the table: the later process


def test_traced_node_times_split_the_measured_step():
  """With traced in-program times the measured step is spread by them, not by roofline shares: all the
  time on the step's last instruction puts all compute after the gradient all-reduce."""
  from perfmodel.graph import hlo_parse as hp
  cfg = _cfg("experiments/configs/emulate_validate.py:layout=data,runlocal=True", [], 2)
  prog = rank_program.build(cfg)
  run = measure.run_rank(prog, 0, execute=False)
  hw = hardware.load("cpu")
  g = tl_lib.build_graph(hp.parse_module(run.hlo_text))
  entry = [n for n in g.regions[g.entry].nodes if n.kind in ("dot", "fusion", "other")]
  times = {n.name: 0.0 for reg in g.regions.values() for n in reg.nodes}
  times[entry[-1].name] = 1.0
  by_roof = tl_lib.rank_timeline(0, run.hlo_text, run.records, 1.0, prog.space, hw, hw)
  traced = tl_lib.rank_timeline(0, run.hlo_text, run.records, 1.0, prog.space, hw, hw, node_times=times)

  def split(tl):
    comm = next(e for e in tl.events if e.cat == "comm")
    before = sum(e.dur for e in tl.events if e.cat == "compute" and e.start < comm.start)
    return before, sum(e.dur for e in tl.events if e.cat == "compute" and e.start > comm.start)
  assert split(by_roof)[0] > 0.1  # roofline: the forward and backward passes come before the all-reduce
  before, after = split(traced)
  assert before == pytest.approx(0.0, abs=1e-9) and after == pytest.approx(1.0, rel=1e-6)


def test_gloo_calibration_of_some_kinds_keeps_the_stored_curves_of_the_others(tmp_path, monkeypatch):
  from perfmodel.emulate import localrun
  path = tmp_path / "gloo.json"
  path.write_text(json.dumps({k: {kind: [[1024.0, 9.0]] for kind in gloo_calibration.KINDS}
                              for k in ("curves", "next_curves", "raw_with_collective_s", "raw_local_only_s")}
                             | {"source": "before"}))
  seen = {}

  def fake_run(cmds, cores, timeout_s=0):
    seen["kinds"] = cmds[0][-1]
    raw = {kind: [[1024.0, 1.0, 2.0, 3.0, 4.0]] for kind in cmds[0][-1].split(",")}
    return localrun.Done(rc=[0, 0], stdout=["@@" + json.dumps(raw), ""], stderr=["", ""], wall_s=1.0)
  monkeypatch.setattr(localrun, "run_pinned", fake_run)
  monkeypatch.setattr(localrun, "cores", lambda: [0, 1])
  res = gloo_calibration.calibrate(str(path), reps=3, k=2, kinds=("all-reduce",))
  assert seen["kinds"] == "all-reduce"
  stored = json.loads(path.read_text())
  assert stored["curves"]["all-reduce"] == [[1024.0, 1.0]] and stored["next_curves"]["all-reduce"] == [[1024.0, 4.0]]
  assert stored["curves"]["collective-permute"] == [[1024.0, 9.0]]  # not re-measured: kept
  assert res["source_by_kind"]["collective-permute"] == "before" and "before" not in res["source"]
  with pytest.raises(ValueError, match="unknown collective kinds"):
    gloo_calibration.calibrate(str(path), kinds=("all-to-all",))


def test_partial_gloo_calibrations_keep_one_flat_source_per_kind():
  """Re-measuring some kinds keeps the others' curves and records each kind's source once, flat."""
  from perfmodel.emulate import gloo_calibration as gc
  old = {"curves": {"all-reduce": [[1, 1.0]], "all-gather": [[1, 2.0]]}, "source": "run A"}
  for run in ("run D", "run E", "run F"):
    new = {"curves": {"all-reduce": [[1, 0.5]]}, "next_curves": {}, "raw_with_collective_s": {},
           "raw_local_only_s": {}, "source": run}
    old = gc.merge_partial(new, old, ["all-reduce"])
  assert old["curves"] == {"all-reduce": [[1, 0.5]], "all-gather": [[1, 2.0]]}
  assert old["source_by_kind"] == {"all-reduce": "run F", "all-gather": "run A"}
  assert old["source"].startswith("run F (kinds all-reduce;") and "run E" not in old["source"]
  full = gc.merge_partial({"curves": {k: [] for k in gc.KINDS}, "source": "run G"}, None, gc.KINDS)
  assert set(full["source_by_kind"].values()) == {"run G"}


def test_a_graphs_collective_permute_is_priced_from_a_measured_curve_when_the_profile_has_one():
  """Prediction (node_cost) and emulation (cost) price a permute alike: from the host's measured curve when
  there is one (calibrate's in-program marginal cost), from the link levels' latency and bandwidth otherwise."""
  from perfmodel.graph.nodes import CollectiveInfo
  info = CollectiveInfo("collective-permute", 2, 1, 65536.0, "{{0,1},{1,0}}", n_devices=2)
  base = hardware.load("cpu")
  linked = dataclasses.replace(base, collective_curve={})
  c = collectives.node_cost(info, linked)
  assert c.algorithm == "direct" and c.seconds > 0
  hw = dataclasses.replace(base, collective_curve={"collective-permute": [[1024.0, 1e-5], [1048576.0, 9e-5]]})
  m = collectives.node_cost(info, hw)
  assert m.algorithm == "measured"
  assert np.isclose(m.seconds, hardware.interp_log(hw.collective_curve["collective-permute"], 65536.0))
  assert np.isclose(m.seconds, collectives.cost("collective-permute", 65536.0, (0, 1), hw).seconds)


def test_in_process_collective_curves_are_the_marginal_cost_inside_a_program():
  """calibrate's curves: k chained collectives minus the same loop without them; positive, and growing with the
  payload from 4 KB to 16 MB (a 16 MB all-reduce moves 4096x the bytes of a 4 KB one)."""
  from perfmodel.calib import collective_bench
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:2])
  x = jax.device_put(np.arange(2 * 64, dtype=np.float32),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
  for kind in collective_bench.KINDS:
    with_c = collective_bench.chained(mesh, kind, 64, 3, True)(x)
    without = collective_bench.chained(mesh, kind, 64, 3, False)(x)
    assert with_c.shape == without.shape == x.shape
    assert not np.allclose(with_c, without)  # the collective ran: the devices' halves mixed
    pts = collective_bench.marginal_curve(mesh, kind, [4 ** 6, 4 ** 12], k=4, reps=3)
    assert all(t > 0 for _, t in pts) and pts[1][1] > pts[0][1]
