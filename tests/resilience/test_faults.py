"""One test per class of bad-input / fault cases (resilience/faults_cases.py): every case must end in a checked
recovery or in one clear error line, with no crash, no hang and nothing lost. The classes that run training
jobs take minutes and are marked slow; ``benchmarks/reliability_resilience.py`` runs them all and counts."""
import os

import pytest

from resilience import fault_suite, faults

fault_suite.load_cases()
SLOW_CLASSES = {c.klass for c in faults.CASES if c.slow} | {"checkpoint_corrupt", "checkpoint_partial",
                                                             "checkpoint_foreign", "checkpoint_kill"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, cache_dir):
  return faults.Workspace(str(tmp_path_factory.mktemp("faults")), cache_dir=cache_dir)


def _check_class(klass, ws):
  bad = {}
  for c in [c for c in faults.CASES if c.klass == klass]:
    o = faults.run_case(c, ws)
    if o.kind not in ("recovered", "clear_error") or o.data_lost:
      bad[c.name] = o.as_dict()
  assert not bad, bad


@pytest.mark.parametrize("klass", [k for k in faults.classes() if k not in SLOW_CLASSES])
def test_fault_class(klass, workspace):
  if klass == "disk_full" and os.geteuid() != 0:  # the in-process stand-in: tests/framework/test_disk_full.py
    pytest.skip("mounting the size-capped tmpfs needs root")
  _check_class(klass, workspace)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("klass", sorted(SLOW_CLASSES))
def test_slow_fault_class(klass, workspace):
  _check_class(klass, workspace)


def test_cli_errors_are_one_line(monkeypatch, capsys):
  """experiments.run.cli turns the errors a user can fix into one stderr line and an exit code (the slow
  checkpoint classes reach the same lines through real runs)."""
  from experiments import run as run_mod
  from framework.checkpoint import CheckpointError
  from resilience.recovery import RunFailed
  from framework.workdir import WorkdirError
  for exc, rc, prefix in [(CheckpointError("checkpoint step 4 in /w is x: use a fresh --workdir"), 3, "checkpoint error: "),
                          (RunFailed("agents did not come up: check the logs"), 4, "hot-swap run failed: "),
                          (WorkdirError("--workdir /w is in use by another training run: pid 7; wait for it"), 5,
                           "workdir error: "),
                          (OSError(28, "No space left on device", "/w/metrics.jsonl"), 5, "workdir error: ")]:
    def boom(argv=None, exc=exc):
      raise exc
    monkeypatch.setattr(run_mod, "main", boom)
    assert run_mod.cli([]) == rc
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(prefix), err
    if not isinstance(exc, OSError):
      assert err.splitlines() == [prefix + str(exc)]
    assert faults.classify(faults.Run(rc, "", err, [], [], 0.0)).kind == "clear_error"
  from framework.config import ConfigError
  monkeypatch.setattr(run_mod, "main", lambda argv=None: (_ for _ in ()).throw(ConfigError("a.b must be int")))
  assert run_mod.cli([]) == 2 and capsys.readouterr().err == "config error: a.b must be int\n"
  with pytest.raises(ConfigError):  # --debug: the traceback instead of the line
    run_mod.cli(["--debug"])


def test_classify_tells_outcomes_apart():
  run = lambda rc, err="", out="", pids=(), shm=(): faults.Run(rc, out, err, list(pids), list(shm), 0.0)  # noqa
  assert faults.classify(run(None)).kind == "hang"
  assert faults.classify(run(1, "Traceback (most recent call last):\n  x\nValueError: y")).kind == "crash"
  assert faults.classify(run(-9)).kind == "crash"
  assert faults.classify(run(2, "log line\nconfig error: a.b must be int, got 'x'")).kind == "clear_error"
  assert faults.classify(run(2, "config error: something is off")).kind == "unclear_error"  # names no fix
  assert faults.classify(run(2, "config error: x must be int\ntrailing noise")).kind == "unclear_error"
  assert faults.classify(run(0)).kind == "silent"  # success that nobody checked
  assert faults.classify(run(0), ok=lambda r: True).kind == "recovered"
  o = faults.classify(run(0, pids=[123]), ok=lambda r: True)
  assert o.kind == "recovered" and o.data_lost  # a process outlived the job


def test_lost_files_accepts_moved_aside_intact(tmp_path):
  step = tmp_path / "checkpoints" / "4" / "state"
  step.mkdir(parents=True)
  (step / "a").write_bytes(b"data")
  before = faults.committed_files(str(tmp_path))
  assert list(before) == ["checkpoints/4/state/a"]
  aside = tmp_path / "checkpoints_bad" / "4-1" / "state"
  aside.mkdir(parents=True)
  (step / "a").rename(aside / "a")
  assert faults.lost_files(before, str(tmp_path)) == []
  (aside / "a").write_bytes(b"changed")
  assert faults.lost_files(before, str(tmp_path)) == ["checkpoints/4/state/a"]
