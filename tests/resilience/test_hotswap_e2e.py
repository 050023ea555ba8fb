"""End to end: N=4 nodes + spares on localhost, one injected failure per test, compared bit for bit
with a failure-free run of the same config. Each job runs in its own session under a hard timeout
and every process is SIGKILLed afterwards (tests/resilience/jobs.py)."""
import pytest

from tests.resilience.jobs import assert_identical, run_job

pytestmark = pytest.mark.multiprocess


def _check(ref_pair, wd, out, kinds_tier=("memory",), recoveries=1, max_recomputed=1):
  ref_wd, ref = ref_pair
  assert len(out["recoveries"]) == recoveries, out["recoveries"]
  for rec in out["recoveries"]:
    assert rec["tier"] in kinds_tier, rec
    assert rec["steps_recomputed"] <= max_recomputed, rec
    assert rec["recovery_time_s"] > 0
  assert_identical(ref, out, ref_wd, wd)


def test_replication_kill_recomputes_identically(cache_dir, tmp_path):
  """Default (one job, no reference run): node 1 dies while sending snapshot v5, so v5 never commits, the
  spare restores v4 from node 2's replica and step 5 is computed again in the new generation; its loss
  must equal the first computation bit for bit (the full-trajectory comparisons are the slow tests)."""
  out = run_job(tmp_path, cache_dir, fail_at=4, fail_kind="replication", fail_rank=1)
  assert len(out["recoveries"]) == 1
  rec = out["recoveries"][0]
  assert rec["tier"] == "memory" and rec["failed_ranks"] == [1] and rec["swaps"]["1"] == ["node1", "spare0"]
  assert rec["restored_version"] < rec["last_step"] and rec["steps_recomputed"] == 1
  assert out["recompute_checks"] >= 1 and out["loss_mismatch_on_recompute"] == []  # same loss bits again
  assert set(rec["breakdown_s"]) == {"detect", "rebuild", "restore", "recompile", "first_step"}
  assert out["failures_injected"] == 1 and out["generations"] == 2 and out["committed"] == out["steps"]


@pytest.mark.slow
def test_node_kill_swaps_spare_bit_identical(reference, cache_dir, tmp_path):
  out = run_job(tmp_path, cache_dir, fail_at=4, fail_kind="node", fail_rank=1)
  _check(reference, tmp_path, out)
  rec = out["recoveries"][0]
  assert rec["failed_ranks"] == [1] and rec["swaps"]["1"] == ["node1", "spare0"]
  assert set(rec["breakdown_s"]) == {"detect", "rebuild", "restore", "recompile", "first_step"}
  assert out["failures_injected"] == 1 and out["generations"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("kind,extra,tiers,recs", [
    ("worker", {}, ("memory",), 1),
    ("replication", {}, ("memory",), 1),
    ("hang", {}, ("memory",), 1),
    ("two", {"replicas": 2, "spares": 2}, ("memory",), 1),
    ("two", {"replicas": 1, "spares": 2, "persist_every": 2}, ("persistent",), 1),
    ("recovery", {"spares": 2}, ("memory",), 1),
])
def test_injection_kind(reference, cache_dir, tmp_path, kind, extra, tiers, recs):
  out = run_job(tmp_path, cache_dir, fail_at=4, fail_kind=kind, fail_rank=0, **extra)
  # the persistent tier loses up to persist_every steps (plus the one in flight)
  _check(reference, tmp_path, out, tiers, recs, max_recomputed=extra.get("persist_every", 0) + 1)
  rec = out["recoveries"][0]
  if kind == "hang":
    assert "heartbeat" in rec["causes"][0]
  if kind == "replication":  # the dying node's snapshot v5 never committed: restore v4 (one step redone)
    assert rec["restored_version"] <= rec["last_step"]
  if kind == "two":
    assert len(rec["failed_ranks"]) == 2
  if kind == "recovery":
    assert rec["restarts_during_recovery"] >= 1 and len(rec["failed_ranks"]) == 2


@pytest.mark.slow
def test_spare_kill_then_worker_kill(reference, cache_dir, tmp_path):
  out = run_job(tmp_path, cache_dir, fail_at="2,5", fail_kind="spare,worker", fail_rank=2, spares=2)
  _check(reference, tmp_path, out)
  assert out["spares_killed"] == 1
  assert out["recoveries"][0]["swaps"]["2"][1] == "spare1"  # spare0 was killed while idle
