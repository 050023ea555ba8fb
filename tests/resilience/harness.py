"""Runs one hot-swap job in its own session with a hard timeout; every descendant is SIGKILLed after."""
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_STEPS = 8


def _remove_shm(workdir):
  """A SIGKILLed launcher cannot unlink its run's shared-memory slots: do it for it."""
  try:
    with open(os.path.join(str(workdir), "run_id")) as f:
      run_id = f.read().strip()
  except OSError:
    return
  for p in glob.glob(os.path.join("/dev/shm", f"prismllm-{run_id}-*")) + \
      glob.glob(os.path.join(tempfile.gettempdir(), f"prismllm-{run_id}-*")):
    try:
      os.unlink(p)
    except OSError:
      pass


def run_job(workdir, cache_dir, timeout_s=600, steps=TEST_STEPS, **resilience):
  opts = {"compile_cache_dir": str(cache_dir), "heartbeat_timeout_s": 3.0, "wall_timeout_s": timeout_s - 10,
          **resilience}
  cmd = [sys.executable, "-m", "resilience.launch", "--config", "experiments/configs/hotswap.py:runlocal=True",
         "--workdir", str(workdir), f"--config.train.steps={steps}"]
  cmd += [f"--config.extras.resilience.{k}={v}" for k, v in opts.items()]
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    out = b"(timed out)"
  finally:
    try:  # the launcher's session holds agents and workers (PDEATHSIG also ends them with their parent)
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    proc.wait()
    _remove_shm(workdir)
  text = out.decode(errors="replace")
  path = os.path.join(str(workdir), "hotswap_summary.json")
  assert proc.returncode == 0 and os.path.exists(path), f"hot-swap job failed (rc {proc.returncode}):\n{text[-6000:]}"
  with open(path) as f:
    return json.load(f)


def assert_identical(ref, got, workdir_ref, workdir_got):
  assert got["losses"] == ref["losses"], "loss trajectory differs from the failure-free run"
  assert got["loss_mismatch_on_recompute"] == []
  assert got["final_crc"] == ref["final_crc"]
  for r in range(ref["nodes"]):
    with open(os.path.join(str(workdir_ref), "final", f"rank{r}.bin"), "rb") as a, \
         open(os.path.join(str(workdir_got), "final", f"rank{r}.bin"), "rb") as b:
      assert a.read() == b.read(), f"final state of rank {r} differs"
