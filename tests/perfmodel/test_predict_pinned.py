"""`perfmodel predict` output pinned for four programs: a refactor of the model must not move a prediction.

Each golden file holds the command line and the JSON it printed (quickstart data x tensor, a 1F1B pipeline, a
KV-cached decode, Llama-3-70B at 8192 ranks). Backends that time the program on this host (profiled, hybrid)
are not pinned: their prices depend on the host; the learned backend and the datasheet profiles are pure
functions of committed data. A deliberate change of a prediction regenerates the golden file in the same commit.
"""
import json
import math
import os
import subprocess
import sys

import pytest

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "predict")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# wall-clock fields of a prediction (how long it took, not what it predicts)
WALL = {"compile_s", "predict_s", "profile_s", "trace_s", "wall_s", "timing"}


def _compare(want, got, path=""):
  if isinstance(want, dict):
    assert isinstance(got, dict), path
    missing = set(want) - set(got) - WALL
    assert not missing, f"{path}: fields gone {sorted(missing)}"
    for k, v in want.items():
      if k in WALL or (k == "total_s" and path == "" and want.get("mode") == "train"):
        continue
      _compare(v, got[k], f"{path}.{k}")
  elif isinstance(want, list):
    assert isinstance(got, list) and len(got) == len(want), path
    for i, (a, b) in enumerate(zip(want, got)):
      _compare(a, b, f"{path}[{i}]")
  elif isinstance(want, float) and not isinstance(want, bool):
    assert math.isclose(want, got, rel_tol=1e-9, abs_tol=1e-15), f"{path}: {got!r} != pinned {want!r}"
  else:
    assert want == got, f"{path}: {got!r} != pinned {want!r}"


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(GOLDEN)))
def test_predict_output_pinned(name):
  with open(os.path.join(GOLDEN, f"{name}.json")) as f:
    golden = json.load(f)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  r = subprocess.run([sys.executable, "-m", "perfmodel", *golden["argv"]], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  got = json.loads(r.stdout.strip().splitlines()[-1])
  _compare(golden["output"], got)
