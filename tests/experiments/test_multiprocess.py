"""2 processes (jax.distributed, gloo on localhost, 4 emulated devices each) train exactly like 1 process
with 8 devices: ``python -m experiments.run ... --processes 2`` against the in-process run.

Same mesh (data=2 x tensor=4), same global batch, same init: each process feeds only its own rows. The
losses may differ only by float summation order in the cross-process all-reduce (gloo sums in its own
order), hence rtol 1e-5 on losses that are ~5.5; in practice they agree to ~1e-7.
"""
import json
import os
import pathlib

import pytest

from experiments import run
from parallelism import distributed

pytestmark = [pytest.mark.multiprocess, pytest.mark.entry]

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # hard limit for the 2-process job; the launcher SIGKILLs both process groups after it
ARGS = ["--config", str(REPO / "experiments/configs/quickstart.py") + ":runlocal=True",
        "--config.train.steps=4", "--config.train.log_every=1", "--config.train.progress=False",
        "--config.train.peak_flops=1e12", "--config.train.sample_tokens=0", "--config.checkpoint.every=2"]
# (sampling is tested in tests/framework; the multi-process save of orbax checkpoints is kept on purpose)


def _losses(workdir):
  rows = [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


# data=2 x tensor=4: each process holds half the batch. pipeline=2 x tensor=4 (shard_map): the batch is
# replicated over both processes, so each must feed all rows (CompiledStep.local_rows), not half of them.
LAYOUTS = {
    "data2_tensor4": [],
    "pipeline2_tensor4": ["--config.mesh.data=1", "--config.mesh.pipeline=2", "--config.mesh.form=shard_map",
                          "--config.mesh.microbatches=2"],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_processes_match_one(tmp_path, monkeypatch, capfd, layout):
  launched = []
  args = [*ARGS, *LAYOUTS[layout]]

  def launch_with_timeout(argv, processes, host_devices, **kw):
    launched.append((list(argv), processes, host_devices))
    return real_launch(argv, processes, host_devices, timeout_s=TIMEOUT_S)

  real_launch = distributed.launch_local
  monkeypatch.setattr(distributed, "launch_local", launch_with_timeout)
  monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.chdir(REPO)
  rc = run.main([*args, "--workdir", str(tmp_path / "two"), "--processes", "2"])
  out = capfd.readouterr()
  assert rc == 0, f"2-process run failed (rc={rc}{', hard timeout' if rc == 124 else ''}):\n{out.err[-4000:]}"
  assert launched and launched[0][1:] == (2, 8) and "--processes" not in launched[0][0]
  assert "process 0/2" in out.err + out.out  # really two jax processes, not a silent fallback to one

  assert run.main([*args, "--workdir", str(tmp_path / "one")]) == 0
  one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
  assert sorted(one) == sorted(two) == [1, 2, 3, 4]
  for s in one:
    assert two[s] == pytest.approx(one[s], rel=1e-5, abs=0), (s, one, two)
  assert one[4] < one[1]
  # Both wrote a checkpoint at step 4 (process 0 coordinates the multi-process save).
  assert (tmp_path / "two" / "checkpoints" / "4").exists() and (tmp_path / "one" / "checkpoints" / "4").exists()
