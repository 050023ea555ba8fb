"""The controller (the launcher process) is SIGKILLed mid-run: every agent, zygote and worker exits by itself,
no shared-memory segment of the job is left, and a rerun in the same workdir resumes from the last committed
persistent checkpoint (not step 0) and ends bit-identical to a failure-free run."""
import os
import signal
import time

import pytest

from benchmarks.reliability import harness
from framework import checkpoint as ckpt_lib
from tests.resilience import jobs

pytestmark = pytest.mark.multiprocess
SMALL = {"nodes": 2, "spares": 0, "persist_every": 3}  # two nodes: a cheap job on a 2-core host
STEPS = 15


def _kill_after_checkpoint(workdir, cache_dir, min_step, timeout_s=400, **opts):
  """Starts a job, SIGKILLs its launcher once a persistent checkpoint >= min_step is final; returns what was
  left behind: (pids alive after 40 s, shm segments, run id, the committed step at the kill, output)."""
  proc = jobs.start(jobs.command(workdir, cache_dir, timeout_s, STEPS, **{**SMALL, **opts}))
  ckdir = ckpt_lib.checkpoint_dir(str(workdir))
  end = time.time() + timeout_s
  committed = None
  while time.time() < end and proc.poll() is None:
    committed = ckpt_lib.latest_usable_step(ckdir)
    if committed is not None and committed >= min_step:
      break
    time.sleep(0.05)
  assert proc.poll() is None, "the job ended before it could be killed:\n" + jobs.output(proc)[-3000:]
  assert committed is not None and committed < STEPS, committed
  run_id = (harness.run_ids_of(workdir) or [None])[-1]
  os.kill(proc.pid, signal.SIGKILL)  # the launcher only: agents must notice and clean up by themselves
  proc.wait()
  left = harness.wait_gone(proc.pid, 40.0)
  shm = harness.shm_of(workdir, run_id)
  harness.killpg(proc.pid)
  out = jobs.output(proc)
  for p in (proc.out_path, proc.err_path):
    harness.unlink(p)
  return left, shm, run_id, committed, out


def test_controller_sigkill_cleans_up_and_rerun_resumes(cache_dir, tmp_path):
  wd = tmp_path / "killed"
  left, shm, run_id, committed, out = _kill_after_checkpoint(wd, cache_dir, min_step=3)
  for p in shm:  # do not leak into other tests, but fail below
    os.unlink(p)
  assert left == [], f"processes outlived the SIGKILLed controller: {left}"
  assert shm == [], f"shared memory of run {run_id} left behind: {shm}"
  before = {m["step"]: m["loss"] for m in jobs.metrics(wd)}

  out = jobs.run_job(wd, cache_dir, steps=STEPS, **SMALL)
  assert out["resumed_from"] is not None and out["resumed_from"] >= committed > 0, out["resumed_from"]
  after = jobs.metrics(wd)[len(before):]
  assert after[0]["step"] == out["resumed_from"] + 1  # nothing before the checkpoint is recomputed
  redone = {m["step"]: m["loss"] for m in after if m["step"] in before}
  assert all(before[s] == v for s, v in redone.items()), "a recomputed step's loss differs"
  assert out["committed"] == STEPS and len(out["final_crc"]) == 2

  ref = tmp_path / "reference"
  ref_out = jobs.run_job(ref, cache_dir, steps=STEPS, **SMALL)
  ref_losses = {m["step"]: m["loss"] for m in jobs.metrics(ref)}
  got = {**before, **{m["step"]: m["loss"] for m in after}}
  assert got == ref_losses, "losses differ from the failure-free run"
  assert out["final_crc"] == ref_out["final_crc"]
  jobs.assert_same_final_bytes(ref, wd, 2)
