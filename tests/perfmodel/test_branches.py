"""Conditionals in compile-only prediction: pipeline slots weighted by the schedule, lock-step idle
(perfmodel/pipeline.py)."""
import dataclasses

import numpy as np
import pytest

from framework.config import from_dict, validate
from parallelism import pipeline as pp
from perfmodel import hardware, pipeline as branches, predict, program, timeline
from perfmodel.cost import chain as costs
from perfmodel.graph import from_hlo as G

PIPE = dict(model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64),
            data=dict(seq_len=32, global_batch=8), mesh=dict(pipeline=2, microbatches=4, schedule="gpipe", form="shard_map"),
            train=dict(steps=5))


@pytest.fixture(scope="module")
def piped():
  cfg = validate(from_dict(PIPE), 2)
  flat = validate(from_dict({**PIPE, "mesh": dict(data=1)}), 1)
  return cfg, program.train_step(cfg), program.train_step(flat)


def _dot_flops(g):
  return sum(n.flops * k for n, k in g.walk() if n.kind == "dot")


def test_role_is_the_innermost_pipeline_scope():
  assert branches.role("jit(step)/scan/pp_fwd_slot/cond") == pp.SCOPE_FWD
  assert branches.role("jit(step)/pp_bwd_slot/vjp/pp_last_stage/cond") == pp.SCOPE_LAST
  assert branches.role("jit(step)/layers/cond") is None


def test_pipeline_conditionals_are_weighted_by_the_schedule(piped):
  cfg, cap, flat = piped
  g = G.from_hlo_text(cap.hlo_text, 2)
  conds = [n for n, _ in g.walk() if n.branches]
  assert conds, "the pipelined step has no conditionals"
  chain = costs.make_chain(hardware.load("h100"), "roofline")
  unresolved = _dot_flops(g)  # first (idle) branch of every slot: almost no matmuls
  info = branches.resolve(g, chain, branches.schedule_of(cfg), stage=None)
  assert info["pipeline_schedule"] >= 2 and info["costliest_branch"] == 0
  # Both stages together do the whole model's matmuls once forward and once backward (the forward slot stashes
  # the vjp residuals, nothing is recomputed): the unpipelined step's dot FLOPs. Recomputing the stage forward in
  # the backward slot would give about 1.33x.
  ratio = 2 * _dot_flops(g) / _dot_flops(G.from_hlo_text(flat.hlo_text, 1))
  assert ratio == pytest.approx(1.0, abs=0.02), ratio
  assert _dot_flops(g) > 5 * unresolved


def test_lockstep_idle_of_equal_stages_is_the_gpipe_bubble():
  s = pp.make_schedule("gpipe", 4, 8)
  f, b = 1.0, 2.0
  for stage in range(4):
    assert branches.lockstep_extra(s, [f] * 4, [b] * 4, stage) == pytest.approx((4 - 1) * (f + b))
  # a slower last stage: the others wait for it every tick it works
  slow = branches.lockstep_extra(s, [1, 1, 1, 2], [2, 2, 2, 4], 0)
  assert slow > 3 * 3


def test_predict_prices_the_work_branches_of_a_pipelined_step(piped):
  cfg, cap, flat = piped
  hw = hardware.load("h100")
  out = predict.predict(cfg, hw, backend="roofline", captured=cap)
  one = predict.predict(validate(from_dict({**PIPE, "mesh": dict(data=1)}), 1), hw, backend="roofline",
                        captured=flat)
  assert out.conditionals["pipeline_schedule"] >= 2
  assert out.conditionals["lockstep_idle_s"] > 0
  # two stages each do about half the work, plus the GPipe bubble: not the idle branch. The stash writes and
  # reads run every tick outside the slots' branches (one small kernel per residual per tick): at this toy size
  # their launches are a large share of the step, so they are counted apart.
  g = G.from_hlo_text(cap.hlo_text, 2)
  stash = sum(k for n, k in g.walk() if n.attribution and "dynamic_update_index_in_dim" in n.attribution.op_name
              or n.attribution and "dynamic_index_in_dim" in n.attribution.op_name)
  assert stash > 0
  rest = out.step_time_s - stash * hw.launch_overhead
  assert 0.5 * one.step_time_s < rest < 3 * one.step_time_s, (rest, one.step_time_s)


def test_unresolved_conditional_is_priced_by_its_costliest_branch(piped):
  cfg, cap, _ = piped
  g = G.from_hlo_text(cap.hlo_text, 2)
  chain = costs.make_chain(hardware.load("h100"), "roofline")
  reg, i, n = next((r, i, n) for r in g.regions.values() for i, n in enumerate(r.nodes)
                   if n.branches and branches.role(n.attribution.op_name) == pp.SCOPE_BWD)
  spans = [timeline.schedule(g, chain, b).makespan for b in n.branches]
  parent = timeline.schedule(g, chain, reg.name).makespan
  reg.nodes[i] = dataclasses.replace(n, branch_weights=(1.0, 0.0))
  idle = timeline.schedule(g, chain, reg.name).makespan
  assert parent - idle == pytest.approx(max(spans) - spans[0], rel=1e-6, abs=1e-12)
  assert np.argmax(spans) == 1  # the backward slot's work branch is the costly one


def test_first_and_last_virtual_stage_conditionals_with_chunks():
  # Interleaved, v = 2: stage 0 embeds for its chunk-0 units only (half its slots), stage P-1 runs the head for
  # its chunk-1 units only; no middle stage does either.
  s = pp.make_schedule("1f1b", 4, 8, 2)
  assert [branches.true_fraction(pp.SCOPE_FIRST, s, st) for st in range(4)] == [0.5, 0.0, 0.0, 0.0]
  assert [branches.true_fraction(pp.SCOPE_LAST, s, st) for st in range(4)] == [0.0, 0.0, 0.0, 0.5]
  assert branches.true_fraction(pp.SCOPE_FWD, s, 0) == pytest.approx(16 / s.n_ticks)


def test_analytic_cost_of_virtual_stages():
  f, b = 1.0, 2.0
  one, two = branches.cost("1f1b", 4, 8, f, b), branches.cost("1f1b", 4, 8, f, b, v=2)
  assert one.step_time == pytest.approx((8 + 3) * (f + b))
  assert two.step_time == pytest.approx((16 + 3) * (f + b) / 2)
  assert two.bubble_fraction == pytest.approx(3 / 19)
  assert branches.cost("1f1b", 4, 8, f, b, c=0.5, v=2).step_time == pytest.approx(two.step_time + 2 * 7 * 0.5)
