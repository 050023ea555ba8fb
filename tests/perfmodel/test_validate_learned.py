"""Re-pricing the committed validation sets reproduces the recorded errors (tests/perfmodel/golden/
validate_learned.json): the learned backend is a pure function of committed data (profile, node samples, stored
measurements), so a refactor of the model must not move a figure. One set per process, one after the other."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "validate_learned.json")


@pytest.mark.slow
def test_learned_repricing_of_the_committed_sets_is_unchanged(tmp_path):
  with open(GOLDEN) as f:
    golden = json.load(f)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  for name, want in sorted(golden["sets"].items()):
    path = os.path.join("benchmarks", "data", f"{name}.json")
    r = subprocess.run([sys.executable, "-m", "perfmodel", "validate", "--measurements", path, "--backend",
                        golden["backend"], "--png", str(tmp_path / f"{name}.png")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for k, v in want.items():
      assert math.isclose(got[k], v, rel_tol=1e-9, abs_tol=1e-12), f"{name}.{k}: {got[k]!r} != recorded {v!r}"
