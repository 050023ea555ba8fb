"""Quiet start: the quickstart's output on a machine without a GPU has no CUDA / absl start-up lines
(framework/platforms.py); ``--verbose`` shows them."""
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from framework import platforms

pytestmark = pytest.mark.entry

REPO = pathlib.Path(__file__).resolve().parents[2]
NOISE = re.compile(r"cuda|cudart|absl::|InitializeLog|TF_CPP|^[IWE]\d{4} ", re.I | re.M)


def _quickstart(tmp_path, *extra):
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}  # as a user's shell
  env["PYTHONPATH"] = str(REPO)
  r = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                      "experiments/configs/quickstart.py:runlocal=True", "--workdir", str(tmp_path / "wd"),
                      "--config.train.steps=2", "--config.train.peak_flops=1e12", *extra],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout + r.stderr


@pytest.mark.skipif(platforms.has_accelerator(), reason="the lines are kept where an accelerator is attached")
def test_quickstart_output_has_no_cuda_or_absl_lines(tmp_path):
  out = _quickstart(tmp_path)
  assert not NOISE.findall(out), [ln for ln in out.splitlines() if NOISE.search(ln)][:5]
  assert '"final_loss"' in out  # the run itself printed what it should
  if importlib.util.find_spec("jax_plugins.xla_cuda12") is not None:  # the test extra's compile-only plugin
    loud = _quickstart(tmp_path, "--verbose")  # the filter is what removed them, and --verbose shows them
    assert "Could not find cuda drivers" in loud


def test_filter_drops_only_the_known_lines(capfd):
  with platforms.filtered_stderr():
    os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n")
    os.write(2, b"I0000 00:00:1796458796.870016   12740 cudart_stub.cc:31] Could not find cuda drivers on your "
                b"machine, GPU will not be used.\n")
    os.write(2, b"E0000 00:00:1.0  1 plugin.cc:1] a real error\n")
    print("python's stderr is kept too", file=sys.stderr)
  err = capfd.readouterr().err
  assert sorted(err.splitlines()) == ["E0000 00:00:1.0  1 plugin.cc:1] a real error", "python's stderr is kept too"]
