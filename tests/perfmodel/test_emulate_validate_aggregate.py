"""benchmarks/emulate_validate.py's summary: each emulation is compared with the real runs bracketing it."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
  spec = importlib.util.spec_from_file_location("ev_bench", os.path.join(ROOT, "benchmarks", "emulate_validate.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _real(median):
  return {"median": median, "p10": 0.95 * median, "p90": 1.05 * median, "memory_per_rank": [{"peak_bytes": 100}] * 2,
          "put_batch_workaround": False}


def _emu(t):
  rank = {"iteration_time_s": t, "per_rank_program_memory": {"peak_bytes": 100}, "noise_p10_p90": 0.05,
          "comm_s": 0.01, "wait_s": 0.0, "straggler_wait_s": 0.0, "collective_calls_per_step": 1}
  return {"iteration_time_s": t, "ranks": [rank], "exact_memory": {"peak_bytes": 100}}


def test_a_linear_drift_of_the_host_cancels_in_the_bracketed_pairs():
  ev = _bench()
  # The host slows 10% per run; the emulation (run between the two real runs) is exact at its own moment.
  rounds = [{"layouts": {"data": {"real": _real(1.0), "emulated": _emu(1.1), "real_after": _real(1.2)}}},
            {"layouts": {"data": {"real": _real(1.3), "emulated": _emu(1.4), "real_after": _real(1.5)}}}]
  per = ev.aggregate(rounds, ["data"], predict=False)["data"]
  assert per["paired_error_pct"] == pytest.approx([0.0, 0.0], abs=1e-9)
  assert per["paired_error_before_only_pct"] == pytest.approx([10.0, 100 * (1.4 / 1.3 - 1)])
  assert per["real_drift_across_emulation_pct"] == pytest.approx([20.0, 100 * (1.5 / 1.3 - 1)])
  assert per["real_s"] == pytest.approx(1.25)  # the median over all four real runs
  assert per["memory_error_bytes"] == 0


def test_without_a_real_run_after_the_emulation_the_pair_is_the_run_before():
  ev = _bench()
  rounds = [{"layouts": {"data": {"real": _real(1.0), "emulated": _emu(1.05)}}}]
  per = ev.aggregate(rounds, ["data"], predict=False)["data"]
  assert per["paired_error_pct"] == pytest.approx([5.0])
  assert per["real_drift_across_emulation_pct"] == []


def test_the_whole_step_wait_model_is_reported_beside_the_per_call_waits():
  """Per-call waits of 0.03 s took the place of a 0.02 s whole-step straggler estimate (nothing of it added):
  with the whole estimate instead of them the emulation is 0.01 s shorter (1.05 - 0.03 + 0.02)."""
  ev = _bench()
  emu = _emu(1.05)
  emu["ranks"][0].update(per_call_wait_s=0.03, straggler_wait_s=0.0, straggler_estimate_s=0.02)
  rounds = [{"layouts": {"tensor": {"real": _real(1.0), "emulated": emu, "real_after": _real(1.0)}}}]
  per = ev.aggregate(rounds, ["tensor"], predict=False)["tensor"]
  assert per["error_pct"] == pytest.approx(5.0)
  assert per["error_without_call_waits_pct"] == pytest.approx(4.0)
  assert per["emulated_per_call_wait_s"] == pytest.approx(0.03)
  old = _emu(1.05)  # a result without per-call waits: the same number in both columns
  per_old = ev.aggregate([{"layouts": {"data": {"real": _real(1.0), "emulated": old}}}], ["data"], predict=False)
  assert per_old["data"]["error_without_call_waits_pct"] == pytest.approx(per_old["data"]["error_pct"])
