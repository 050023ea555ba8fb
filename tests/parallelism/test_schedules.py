"""Pipeline schedules as data: dependencies, stash safety, memory and bubble properties."""
import dataclasses

import numpy as np
import pytest

from parallelism import schedules

PMV = [(2, 1, 1), (2, 4, 1), (4, 4, 1), (4, 8, 1), (8, 3, 1), (8, 32, 1),
       (2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2), (8, 8, 3)]


@pytest.mark.parametrize("name", schedules.SCHEDULES)
@pytest.mark.parametrize("p,m,v", PMV)
def test_schedule_is_valid(name, p, m, v):
  s = schedules.make_schedule(name, p, m, v)  # runs check_schedule
  assert (s.fwd_TxP >= 0).sum() == (s.bwd_TxP >= 0).sum() == p * m * v
  assert s.n_ticks == (2 * (v * m + p - 1) if name == "gpipe" else v * m + v * p + p - 2)


@pytest.mark.parametrize("name", schedules.SCHEDULES)
@pytest.mark.parametrize("p,m,v", PMV)
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)])
def test_bubble_of_the_table_is_the_closed_form(name, p, m, v, f, b):
  # The tick table, priced tick by tick (each tick lasts as long as its busiest stage, idle slots skipped),
  # against (P-1)/(vM + P - 1): the textbook bubble for v = 1, (P-1)/(vM) relative to the ideal for v > 1.
  s = schedules.make_schedule(name, p, m, v)
  formula = schedules.bubble_formula(name, p, m, v)
  assert s.bubble_fraction(f, b) == pytest.approx(formula, rel=1e-12)
  assert formula / (1 - formula) == pytest.approx((p - 1) / (v * m))


def test_virtual_stages_shrink_the_bubble():
  one = schedules.make_schedule("1f1b", 4, 8, 1).bubble_fraction()
  two = schedules.make_schedule("1f1b", 4, 8, 2).bubble_fraction()
  four = schedules.make_schedule("1f1b", 4, 8, 4).bubble_fraction()
  assert one > two > four
  assert two == pytest.approx(3 / 19) and one == pytest.approx(3 / 11)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 32), (8, 64)])
def test_1f1b_memory_is_bounded_by_stages_gpipe_by_microbatches(p, m):
  g = schedules.make_schedule("gpipe", p, m)
  f = schedules.make_schedule("1f1b", p, m)
  assert g.peak_in_flight() == [m] * p
  assert f.peak_in_flight() == [min(m, 2 * (p - 1 - s) + 1) for s in range(p)]
  assert f.n_slots == min(m, 2 * p - 1) and g.n_slots == m
  assert f.n_head_slots == 1 and g.n_head_slots == m


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2), (4, 4, 3)])
def test_interleaved_stash_is_megatrons_warmup(p, m, v):
  # Megatron's interleaved 1F1B: stage 0 runs (P-1)*2 + (v-1)*P warm-up forwards plus one before its first
  # backward: (v+1)P - 1 units in flight, capped by the vM units there are. Circular GPipe holds all vM.
  f = schedules.make_schedule("1f1b", p, m, v)
  assert f.n_slots == f.peak_in_flight()[0] == min(v * m, (v + 1) * p - 1)
  assert schedules.make_schedule("gpipe", p, m, v).n_slots == v * m


def test_round_robin_placement_and_ring():
  s = schedules.make_schedule("1f1b", 2, 2, 2)
  # stage 0 runs virtual stages 0 and 2, stage 1 runs 1 and 3; micro-batch 0 goes 0 -> 1 -> 2 -> 3 in 4 ticks
  vs = s.virtual_stage(s.fwd_chunk_TxP)
  path = [(t, st, int(vs[t, st])) for t in range(s.n_ticks) for st in range(2) if s.fwd_TxP[t, st] == 0]
  assert path == [(0, 0, 0), (1, 1, 1), (2, 0, 2), (3, 1, 3)]


def test_check_schedule_catches_a_broken_table():
  s = schedules.make_schedule("1f1b", 4, 4)
  bad = dataclasses.replace(s, bwd_TxP=np.roll(s.bwd_TxP, -1, axis=0))
  with pytest.raises(AssertionError):
    schedules.check_schedule(bad)
  tight = dataclasses.replace(s, fwd_slot_TxP=np.where(s.fwd_TxP >= 0, s.fwd_TxP % 2, -1),
                              bwd_slot_TxP=np.where(s.bwd_TxP >= 0, s.bwd_TxP % 2, -1), n_slots=2)
  with pytest.raises(AssertionError, match="stash"):  # too few stash slots
    schedules.check_schedule(tight)
  g = schedules.make_schedule("gpipe", 4, 4)
  with pytest.raises(AssertionError, match="head input"):  # GPipe's head runs ticks after its forward
    schedules.check_schedule(dataclasses.replace(g, n_head_slots=1))
  v2 = schedules.make_schedule("1f1b", 2, 2, 2)
  swapped = dataclasses.replace(v2, fwd_chunk_TxP=np.where(v2.fwd_TxP >= 0, 1 - v2.fwd_chunk_TxP, -1))
  with pytest.raises(AssertionError, match="virtual stage"):
    schedules.check_schedule(swapped)


def test_virtual_stages_need_whole_groups_of_microbatches():
  with pytest.raises(ValueError, match="multiple of mesh.pipeline"):
    schedules.make_schedule("1f1b", 4, 6, 2)


def test_masked_bubbles_of_the_jit_form():
  # The jit form cannot skip idle slots (see pipeline.loss_and_grads_body): every tick costs a whole slot pair.
  p, m = 4, 8
  assert schedules.make_schedule("1f1b", p, m).bubble_fraction(masked=True) == pytest.approx(
      2 * (p - 1) / (m + 2 * (p - 1)))
  assert schedules.make_schedule("gpipe", p, m).bubble_fraction(masked=True) == pytest.approx(
      1 - m / (2 * (m + p - 1)))
  s = schedules.make_schedule("1f1b", p, m, 2)
  assert s.bubble_fraction(masked=True) == pytest.approx(1 - 2 * m / s.n_ticks)
