"""Every experiment config in experiments/configs/ runs 2 steps through the real entry point.

The folder is iterated, so a config another engineer adds is covered without touching this file. Each
config runs with its ``runlocal`` variant when it has one, as ``python -m experiments.run`` in its own
process with ``--host-devices`` equal to its mesh size (8 when the mesh has a -1 axis). The runs start
together (they are mostly single-threaded start-up and compilation, so two cores overlap them) and
every child is killed when the module finishes or the hard timeout passes.

Skipped, always with the reason printed: configs too large to train on a CPU that offer no runlocal
variant (the fix: add one), and hot-swap configs (extras.resilience), which start 5 node processes and
are covered end to end by tests/resilience/test_hotswap_e2e.py (they run here too under ``-m slow``).
"""
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from framework import config_file
from framework.config import ConfigError, from_dict

pytestmark = pytest.mark.entry

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (REPO / "experiments" / "configs").glob("*.py") if p.name != "__init__.py")
CPU_PARAM_LIMIT = 50e6  # a 2-step CPU smoke run of anything larger takes minutes
TIMEOUT_S = 420
STEPS = 2


def _plan(path: pathlib.Path) -> dict:
  """How to run one config: spec, device count, or why not."""
  spec = str(path)
  cfg = from_dict(config_file.load_configdict(spec))
  try:
    local = from_dict(config_file.load_configdict(spec + ":runlocal=True"))
  except ConfigError:  # get_config rejects the argument: no runlocal variant
    local = cfg
  if local != cfg:  # (a get_config that ignores its argument has no variant either)
    spec, cfg = spec + ":runlocal=True", local
  plan = {"spec": spec, "name": path.stem, "runlocal": spec.endswith("runlocal=True")}
  if "resilience" in dict(cfg.extras):
    plan["skip"] = ("hot-swap config (extras.resilience): starts 5 node processes, ~1 min of CPU; "
                    "covered end to end by tests/resilience/test_hotswap_e2e.py, and run here under -m slow")
    plan["slow"] = True
  if not plan["runlocal"] and cfg.model.n_params() > CPU_PARAM_LIMIT:
    plan["skip"] = (f"{cfg.model.n_params() / 1e6:.0f}M parameters and no runlocal variant: too large for "
                    f"a 2-step CPU run; add a ':runlocal=True' variant to {path.name} to have it tested here")
    plan.pop("slow", None)
  sizes = cfg.mesh.sizes()
  plan["devices"] = 8 if -1 in sizes.values() else math.prod(sizes.values())
  return plan


PLANS = {p.stem: _plan(p) for p in CONFIGS}


def _start(plan, workdir):
  cmd = [sys.executable, "-m", "experiments.run", "--config", plan["spec"], "--workdir", str(workdir),
         "--host-devices", str(plan["devices"]), f"--config.train.steps={STEPS}", "--config.train.progress=False",
         "--config.train.peak_flops=1e12"]  # skips the start-up matmul probe
  env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)  # experiments.run sets the device count from --host-devices
  log = open(workdir.parent / f"{plan['name']}.log", "w")
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  return proc, log


def _kill(proc):
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)  # the whole session: a hot-swap run has node processes below it
    except ProcessLookupError:
      pass
  proc.wait()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Starts every runnable config at once; yields name -> (returncode, workdir, log text)."""
  root = tmp_path_factory.mktemp("configs")
  started = {}
  try:
    for name, plan in PLANS.items():
      if "skip" in plan:
        continue
      wd = root / name / "wd"
      wd.parent.mkdir()
      started[name] = (*_start(plan, wd), wd)
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline and any(p.poll() is None for p, _, _ in started.values()):
      time.sleep(0.5)
    out = {}
    for name, (p, log, wd) in started.items():
      timed_out = p.poll() is None
      _kill(p)
      log.close()
      text = (root / name / f"{name}.log").read_text(errors="replace")
      out[name] = (124 if timed_out else p.returncode, wd, text)
    yield out
  finally:
    for p, log, _ in started.values():
      _kill(p)
      log.close()


def _check(name, result):
  rc, wd, log = result
  assert rc == 0, f"{name} exited {rc}{' (hard timeout)' if rc == 124 else ''}:\n{log[-4000:]}"
  rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
  assert sorted(losses) == [1, 2] or sorted(losses) == [1] + [STEPS], losses
  assert all(math.isfinite(v) and 0 < v < 20 for v in losses.values()), losses
  summary = json.loads(log.strip().splitlines()[-1])
  assert summary["steps"] == STEPS


@pytest.mark.parametrize("name", sorted(PLANS))
def test_config_runs_two_steps(name, runs):
  plan = PLANS[name]
  if "skip" in plan:
    pytest.skip(plan["skip"])
  _check(name, runs[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n, p in PLANS.items() if p.get("slow")))
def test_slow_config_runs_two_steps(name, tmp_path):
  """The configs skipped above for cost, run one by one (-m slow)."""
  plan = PLANS[name]
  wd = tmp_path / "wd"
  proc, log = _start(plan, wd)
  try:
    proc.wait(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    pass
  finally:
    _kill(proc)
    log.close()
  text = (tmp_path / f"{name}.log").read_text(errors="replace")
  assert proc.returncode == 0, text[-4000:]
  assert json.loads(text.strip().splitlines()[-1])["steps"] == STEPS


def test_every_config_loads_and_has_a_docstring():
  """Cheap checks on all configs, skipped ones included: typed conversion works and the docstring is the record."""
  assert CONFIGS, "no configs found"
  for p in CONFIGS:
    plan = PLANS[p.stem]
    cfg = config_file.load(plan["spec"])
    assert cfg.model.n_params() > 0
    doc = (compile(p.read_text(), str(p), "exec").co_consts[0] or "")
    assert isinstance(doc, str) and doc.strip(), f"{p.name}: add a docstring with the exact command"
