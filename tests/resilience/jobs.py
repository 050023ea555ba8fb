"""Hot-swap jobs for the tests, run through the reliability harness (benchmarks/reliability/harness.py): the
launcher in its own session under a hard timeout, every descendant SIGKILLed after.

``run_job`` also checks that a job that exited leaves no process and no shared-memory segment behind (the
harness only removes leftovers after recording them, so a leak fails the test instead of being hidden).
"""
import json
import os

from benchmarks.reliability import harness

TEST_STEPS = 8


def command(workdir, cache_dir, timeout_s=600, steps=TEST_STEPS, config="experiments/configs/hotswap.py:runlocal=True",
            **resilience) -> list:
  """The arguments of ``python -m resilience.launch`` for a test job."""
  opts = {"compile_cache_dir": str(cache_dir), "heartbeat_timeout_s": 3.0, "wall_timeout_s": timeout_s - 10,
          **resilience}
  argv = ["--config", config, "--workdir", str(workdir), f"--config.train.steps={steps}"]
  return argv + [f"--config.extras.resilience.{k}={v}" for k, v in opts.items()]


def start(argv):
  return harness.start(argv, module="resilience.launch")


def output(proc) -> str:
  """What a started job has written so far (stdout, then stderr)."""
  text = ""
  for p in (proc.out_path, proc.err_path):
    with open(p, errors="replace") as f:
      text += f.read()
  return text


def run_job(workdir, cache_dir, timeout_s=600, steps=TEST_STEPS, **resilience):
  r = harness.finish(start(command(workdir, cache_dir, timeout_s, steps, **resilience)), timeout_s, str(workdir))
  path = os.path.join(str(workdir), "hotswap_summary.json")
  assert r.rc == 0 and os.path.exists(path), f"hot-swap job failed (rc {r.rc}):\n{(r.out + r.err)[-6000:]}"
  assert not r.left_pids and not r.left_shm, f"a finished job left processes {r.left_pids} / shared memory {r.left_shm}"
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
