"""Pipeline schedules as data: dependencies, stash safety, memory and bubble properties."""
import numpy as np
import pytest

from parallelism import pipeline


@pytest.mark.parametrize("name", pipeline.SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 3), (8, 32)])
def test_schedule_is_valid(name, p, m):
  s = pipeline.make_schedule(name, p, m)  # runs check_schedule
  assert (s.fwd_TxP >= 0).sum() == (s.bwd_TxP >= 0).sum() == p * m


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 32), (8, 64)])
def test_1f1b_memory_is_bounded_by_stages_gpipe_by_microbatches(p, m):
  g = pipeline.make_schedule("gpipe", p, m)
  f = pipeline.make_schedule("1f1b", p, m)
  assert g.peak_in_flight() == [m] * p
  assert f.peak_in_flight() == [min(m, 2 * (p - 1 - s) + 1) for s in range(p)]
  assert f.n_slots == min(m, 2 * p - 1) and g.n_slots == m


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_bubble_fractions(p, m):
  # Idle slots are skipped (lax.cond), so a tick lasts as long as its busiest stage: both schedules
  # reach the classic (P-1)/(M+P-1) bubble when a backward costs as much as a forward ...
  for name in pipeline.SCHEDULES:
    s = pipeline.make_schedule(name, p, m)
    assert s.bubble_fraction(1.0, 1.0) == pytest.approx((p - 1) / (m + p - 1))
  # ... and for B = 2F, 1F1B's ramp ticks (forward-only / backward-only) keep the same bubble too.
  f = pipeline.make_schedule("1f1b", p, m)
  assert f.bubble_fraction(1.0, 2.0) == pytest.approx((p - 1) / (m + p - 1))


def test_check_schedule_catches_a_broken_table():
  s = pipeline.make_schedule("1f1b", 4, 4)
  bad = pipeline.Schedule(s.name, s.n_stages, s.n_micro, s.fwd_TxP, np.roll(s.bwd_TxP, -1, axis=0), s.n_slots)
  with pytest.raises(AssertionError):
    pipeline.check_schedule(bad)
  tight = pipeline.Schedule(s.name, s.n_stages, s.n_micro, s.fwd_TxP, s.bwd_TxP, 2)  # too few stash slots
  with pytest.raises(AssertionError, match="stash"):
    pipeline.check_schedule(tight)


def test_masked_bubbles_of_the_jit_form():
  # The jit form cannot skip idle slots (see pipeline.loss_and_grads_body): every tick costs F + B.
  p, m = 4, 8
  assert pipeline.make_schedule("1f1b", p, m).bubble_fraction(masked=True) == pytest.approx(
      2 * (p - 1) / (m + 2 * (p - 1)))
  assert pipeline.make_schedule("gpipe", p, m).bubble_fraction(masked=True) == pytest.approx(
      1 - m / (2 * (m + p - 1)))
