"""User commands never write into the repository: predict, validate and emulate, each run as a user runs it (from
the repository root, in a fresh process, with a fresh home and cache), leave ``git status`` as it was; what they
keep goes to the user's cache. Calibrations write the user's cache too, and are read in place of the committed
ones (perfmodel/hardware.py, perfmodel/emulate/gloo_calibration.py)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the smallest form of each command: predict with the learned backend (the default profiles every instruction of
# a program not seen before: ~45 s with an empty cache), the published validation of one row from its committed
# program (no compile), emulation compile-only
COMMANDS = [
    ["-m", "perfmodel", "predict", "--config", "experiments/configs/quickstart.py", "--backend", "learned"],
    ["-m", "perfmodel", "validate", "--published", "--reprice", "--rows", "maxtext_v5e_16b_1x256"],
    ["-m", "perfmodel", "emulate", "--config", "experiments/configs/quickstart.py:runlocal=True", "--compile-only"],
]


def _status() -> str:
  r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                     text=True, check=True)
  return r.stdout


def _user_env(tmp_path) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PRISMLLM_CACHE")}
  for k in ("HOME", "XDG_CACHE_HOME", "TMPDIR"):
    env[k] = str(tmp_path / k.lower())
    os.makedirs(env[k], exist_ok=True)
  env["PYTHONPATH"] = REPO
  return env


def test_user_commands_leave_the_repository_unchanged(tmp_path):
  if shutil.which("git") is None or not os.path.exists(os.path.join(REPO, ".git")):
    pytest.skip("needs git and a git checkout of the repository (compares `git status` before and after)")
  env = _user_env(tmp_path)
  before = _status()
  for argv in COMMANDS:
    r = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(argv)}: rc {r.returncode}\n{r.stderr[-3000:]}"
    assert json.loads(r.stdout.strip().splitlines()[-1]), argv
    assert _status() == before, f"`python {' '.join(argv)}` changed the repository:\n{_status()}"
  # the published plot went to the temporary folder, the programs it may compile to the user's cache
  assert os.path.exists(os.path.join(env["TMPDIR"], "perfmodel_published.png"))


def test_a_calibration_goes_to_the_users_cache_and_is_read_from_there(tmp_path, monkeypatch):
  from perfmodel import hardware
  from perfmodel.calib import calibrate, store
  from perfmodel.cost import database
  monkeypatch.setenv(hardware.CACHE_ENV, str(tmp_path))
  committed = hardware.load("cpu")
  assert calibrate.destination(commit=True) == os.path.join(hardware.PROFILE_DIR, "cpu.json")
  dst = calibrate.destination()
  assert dst == os.path.join(str(tmp_path), "profiles", "cpu.json")
  with open(dst, "rb") as a, open(os.path.join(hardware.PROFILE_DIR, "cpu.json"), "rb") as b:
    assert a.read() == b.read()  # starts as the profile in effect
  assert all(p.startswith(str(tmp_path)) for p in calibrate.files(dst))
  raw = store.read_json(dst)
  raw["mem_bandwidth"]["value"] = committed.mem_bandwidth * 2
  store.write_json(dst, raw)
  assert hardware.load("cpu").mem_bandwidth == committed.mem_bandwidth * 2  # the user's calibration is the one read
  samples = database.calibration_db_path(database.samples_name("cpu"), os.path.dirname(dst))
  assert database.samples_path("cpu") == database.committed_path(database.samples_name("cpu"))
  store.write_json(samples, {"samples": []})
  assert database.samples_path("cpu") == samples
  assert database.profiled_paths("cpu")[1] == database.calibration_db_path(database.db_name("cpu"), os.path.dirname(dst))


def test_gloo_curves_go_to_the_users_cache_and_are_read_from_there(tmp_path, monkeypatch):
  from perfmodel import hardware
  from perfmodel.emulate import gloo_calibration as gc
  monkeypatch.setenv(hardware.CACHE_ENV, str(tmp_path))
  assert gc.current_path() == gc.DEFAULT_PATH
  assert gc.user_path() == os.path.join(str(tmp_path), "emulate", "cpu_gloo.json")
  os.makedirs(os.path.dirname(gc.user_path()))
  with open(gc.user_path(), "w") as f:
    json.dump({"curves": {k: [[1024.0, 1e-3]] for k in gc.KINDS}}, f)
  assert gc.current_path() == gc.user_path()
  with pytest.raises(SystemExit):
    gc.main(["--commit", "--out", str(tmp_path / "x.json")])  # two destinations: refused before measuring
