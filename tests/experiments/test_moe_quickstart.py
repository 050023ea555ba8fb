"""The MoE quickstart (experiments/configs/moe_quickstart.py) trains on CPU through the real entry point and its
loss falls: the ':runlocal=True' variant, 60 steps on 8 emulated devices (data=2 x expert=4, shard_map form, two
all_to_all per MoE layer), in its own process, killed after 5 minutes."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.entry

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_moe_quickstart_loss_falls(tmp_path):
  cmd = [sys.executable, "-m", "experiments.run", "--config", "experiments/configs/moe_quickstart.py:runlocal=True",
         "--workdir", str(tmp_path / "run"), "--host-devices", "8", "--config.train.progress=False",
         "--config.train.peak_flops=1e12"]
  env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) >= 5 and all(math.isfinite(x) for x in losses), losses
  # from ln(256) = 5.55 nats/byte; the bytes of Python source are far from uniform, so 60 steps fall well below
  assert losses[0] > 4.5 and losses[-1] < losses[0] - 1.0, losses
  # the router's counts are in the log: every routed assignment of the step (2 per token per layer) is counted once
  loads = [r for r in rows if "expert_load" in r]
  assert loads, rows[-1]
  load = loads[-1]["expert_load"]
  assert len(load) == 2 and len(load[0]) == 8  # runlocal: 2 layers, 8 experts
  assert all(sum(layer) == 8 * 64 * 2 for layer in load), load  # global batch 8 x 64 tokens x top-2
  assert loads[-1]["expert_imbalance"] >= 1.0
  # predict prices the expert work at that measured imbalance (expert=4: the capacity dispatch at its factor)
  pred = subprocess.run([sys.executable, "-m", "perfmodel", "predict", "--config",
                         "experiments/configs/moe_quickstart.py:runlocal=True", "--hardware", "cpu",
                         "--expert-load", str(tmp_path / "run" / "metrics.jsonl"), "--method", "analytic"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert pred.returncode == 0, pred.stderr[-3000:]
  assert f"{loads[-1]['expert_imbalance']:.3f} x the mean over 4 ranks" in pred.stderr
