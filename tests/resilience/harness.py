"""Runs hot-swap jobs in their own session with a hard timeout; every descendant is SIGKILLed after.

``run_job`` also checks that a job that exited leaves no process and no shared-memory segment behind (the
harness only removes leftovers after recording them, so a leak fails the test instead of being hidden).
"""
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from resilience.faults import session_pids

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_STEPS = 8


def run_id_of(workdir):
  try:
    with open(os.path.join(str(workdir), "run_id")) as f:
      return f.read().split()[-1]
  except (OSError, IndexError):
    return None


def shm_of(workdir, run_id=None):
  rid = run_id or run_id_of(workdir)
  if not rid:
    return []
  return sorted(glob.glob(os.path.join("/dev/shm", f"prismllm-{rid}-*")) +
                glob.glob(os.path.join(tempfile.gettempdir(), f"prismllm-{rid}-*")))


def _remove_shm(workdir):
  for p in shm_of(workdir):
    try:
      os.unlink(p)
    except OSError:
      pass


def command(workdir, cache_dir, timeout_s=600, steps=TEST_STEPS, config="experiments/configs/hotswap.py:runlocal=True",
            entry=("-m", "resilience.launch"), **resilience):
  opts = {"compile_cache_dir": str(cache_dir), "heartbeat_timeout_s": 3.0, "wall_timeout_s": timeout_s - 10,
          **resilience}
  cmd = [sys.executable, *entry, "--config", config, "--workdir", str(workdir), f"--config.train.steps={steps}"]
  return cmd + [f"--config.extras.resilience.{k}={v}" for k, v in opts.items()]


def start(cmd):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)


def finish(proc, workdir, timeout_s):
  """Waits for the launcher; returns (rc, output, processes left, shm segments left) and then removes both."""
  try:
    out, _ = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    out = b"(timed out)"
  left_pids = wait_gone(proc.pid, 15.0)
  left_shm = shm_of(workdir)
  try:  # the launcher's session holds agents and workers (PDEATHSIG also ends them with their parent)
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  for pid in left_pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  proc.wait()
  _remove_shm(workdir)
  return proc.returncode, out.decode(errors="replace"), left_pids, left_shm


def wait_gone(sid, timeout_s):
  end = time.time() + timeout_s
  while True:
    pids = session_pids(sid)
    if not pids or time.time() > end:
      return pids
    time.sleep(0.2)


def run_job(workdir, cache_dir, timeout_s=600, steps=TEST_STEPS, **resilience):
  proc = start(command(workdir, cache_dir, timeout_s, steps, **resilience))
  rc, text, left_pids, left_shm = finish(proc, workdir, timeout_s)
  path = os.path.join(str(workdir), "hotswap_summary.json")
  assert rc == 0 and os.path.exists(path), f"hot-swap job failed (rc {rc}):\n{text[-6000:]}"
  assert not left_pids and not left_shm, f"a finished job left processes {left_pids} / shared memory {left_shm}"
  with open(path) as f:
    return json.load(f)


def metrics(workdir):
  with open(os.path.join(str(workdir), "metrics.jsonl")) as f:
    return [json.loads(x) for x in f if x.strip()]


def assert_identical(ref, got, workdir_ref, workdir_got):
  assert got["losses"] == ref["losses"], "loss trajectory differs from the failure-free run"
  assert got["loss_mismatch_on_recompute"] == []
  assert got["final_crc"] == ref["final_crc"]
  assert_same_final_bytes(workdir_ref, workdir_got, ref["nodes"])


def assert_same_final_bytes(workdir_ref, workdir_got, nodes):
  for r in range(nodes):
    with open(os.path.join(str(workdir_ref), "final", f"rank{r}.bin"), "rb") as a, \
         open(os.path.join(str(workdir_got), "final", f"rank{r}.bin"), "rb") as b:
      assert a.read() == b.read(), f"final state of rank {r} differs"
