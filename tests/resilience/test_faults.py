"""One test per class of bad-input / fault cases of the resilience area (benchmarks/reliability/resilience_area.py
and its case modules): every case must end in a checked recovery or in one clear error line, with no crash, no
hang and nothing lost, and its fault must have happened (``not_exercised`` fails unless a retry exercises it). The
classes that run training jobs take minutes and are marked slow; ``python -m benchmarks.reliability --area
resilience`` runs them all and counts."""
import os

import pytest

from benchmarks.reliability import campaign, harness, resilience_area

CASES = campaign.load_cases("resilience")
SLOW_CLASSES = {c.klass for c in CASES if c.slow} | {"checkpoint_corrupt", "checkpoint_partial",
                                                     "checkpoint_foreign", "checkpoint_kill"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, cache_dir):
  return resilience_area.Workspace(str(tmp_path_factory.mktemp("faults")), cache_dir=cache_dir)


def _check_class(klass, ws):
  bad = {}
  for c in [c for c in CASES if c.klass == klass]:
    o = harness.run_until_exercised(c, ws)
    if o.kind not in harness.OK_KINDS or o.data_lost:
      bad[c.name] = o.as_dict()
  assert not bad, bad


@pytest.mark.parametrize("klass", [k for k in resilience_area.CASES.classes() if k not in SLOW_CLASSES])
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
    assert resilience_area.classify(harness.Run(rc, "", err)).kind == "clear_error"
  from framework.config import ConfigError
  monkeypatch.setattr(run_mod, "main", lambda argv=None: (_ for _ in ()).throw(ConfigError("a.b must be int")))
  assert run_mod.cli([]) == 2 and capsys.readouterr().err == "config error: a.b must be int\n"
  with pytest.raises(ConfigError):  # --debug: the traceback instead of the line
    run_mod.cli(["--debug"])


def test_classify_tells_outcomes_apart():
  run = lambda rc, err="", out="", pids=(), shm=(): harness.Run(rc, out, err, list(pids), list(shm))  # noqa
  classify = resilience_area.classify
  assert classify(run(None)).kind == "hang"
  assert classify(run(1, "Traceback (most recent call last):\n  x\nValueError: y")).kind == "crash"
  assert classify(run(-9)).kind == "crash"
  assert classify(run(2, "log line\nconfig error: a.b must be int, got 'x'")).kind == "clear_error"
  assert classify(run(2, "config error: something is off")).kind == "unclear_error"  # names no fix
  assert classify(run(2, "config error: x must be int\ntrailing noise")).kind == "unclear_error"
  assert classify(run(1, "config error: a.b must be int, got 'x'")).kind == "unclear_error"  # not a refusal's code
  assert classify(run(0)).kind == "silent"  # success that nobody checked
  assert classify(run(0), ok=lambda r: True).kind == "recovered"
  o = classify(run(0, pids=[123]), ok=lambda r: True)
  assert o.kind == "recovered" and o.data_lost  # a process outlived the job
  # the ondevice area's refusal: one `error:` line among usage lines, any exit code above 0
  from benchmarks.reliability import ondevice_area
  assert ondevice_area.classify(run(2, "usage: x [-h]\nx: error: pass --model")).kind == "clear_error"
  assert ondevice_area.classify(run(1, "log line\nerror: pass --model")).kind == "unclear_error"
  assert ondevice_area.classify(harness.Run(None, "", "", exc=harness.Timeout())).kind == "hang"
  assert ondevice_area.classify(harness.Run(None, "", "", exc=KeyError("k"))).kind == "crash"


def test_a_fault_that_did_not_happen_is_not_exercised_counted_apart_and_retried(tmp_path):
  """A case that could not make its fault happen is neither a pass nor hidden: its own kind, counted and named
  apart by summarise, never in OK_KINDS; run_until_exercised tries it again and keeps what the retry found."""
  tries = []

  def flaky(ws):
    tries.append(1)
    if len(tries) == 1:
      raise harness.NotExercised("the run finished before the signal")
    return harness.Outcome("recovered", "checked")
  never = harness.Case("never", "stop", lambda ws: (_ for _ in ()).throw(harness.NotExercised("no signal landed")))
  ws = harness.Workspace(str(tmp_path))
  o = harness.run_case(never, ws)
  assert o.kind == "not_exercised" and "no signal landed" in o.detail and o.kind not in harness.OK_KINDS
  assert harness.run_until_exercised(never, ws).kind == "not_exercised"
  assert harness.run_until_exercised(harness.Case("flaky", "stop", flaky), ws).kind == "recovered" and len(tries) == 2
  s = harness.summarise({"never": o.as_dict(), "ok": harness.Outcome("recovered").as_dict()})
  assert (s["bad_inputs_tried"], s["recovered"], s["not_exercised"], s["not_exercised_cases"]) == (2, 1, 1, ["never"])


def test_runs_hear_sigint_even_when_the_campaign_ignores_it(tmp_path):
  """A campaign started in the background ignores SIGINT; harness.start must not pass that on, or every SIGINT
  case signals a run that cannot hear it."""
  import signal
  old = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    proc = harness.start(["-c", "import signal; print(signal.getsignal(signal.SIGINT))"], module=None)
  finally:
    signal.signal(signal.SIGINT, old)
  r = harness.finish(proc, 60)
  assert r.rc == 0 and "default_int_handler" in r.out, r.err


def test_lost_files_accepts_moved_aside_intact(tmp_path):
  step = tmp_path / "checkpoints" / "4" / "state"
  step.mkdir(parents=True)
  (step / "a").write_bytes(b"data")
  before = harness.committed_files(str(tmp_path))
  assert list(before) == ["checkpoints/4/state/a"]
  aside = tmp_path / "checkpoints_bad" / "4-1" / "state"
  aside.mkdir(parents=True)
  (step / "a").rename(aside / "a")
  assert harness.lost_files(before, str(tmp_path)) == []
  (aside / "a").write_bytes(b"changed")
  assert harness.lost_files(before, str(tmp_path)) == ["checkpoints/4/state/a"]


def test_the_campaign_command_counts_and_writes_only_where_told(tmp_path):
  """``python -m benchmarks.reliability`` on two cases: one JSON object with the counts, the same JSON in --out, and
  the committed benchmarks/data/reliability.json untouched; --commit of a part is refused in one line."""
  import json
  import subprocess
  import sys
  from benchmarks.reliability import campaign
  with open(campaign.COMMITTED, "rb") as f:
    committed = f.read()
  env = harness.env()
  out = tmp_path / "r.json"
  r = subprocess.run([sys.executable, "-m", "benchmarks.reliability", "--area", "resilience", "--only",
                      "config_file_missing", "typo_in_key", "--workdir", str(tmp_path / "ws"), "--out", str(out)],
                     cwd=harness.ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(r.stdout.strip().splitlines()[-1])
  assert json.loads(out.read_text()) == res
  assert (res["total"]["bad_inputs_tried"], res["total"]["clear_errors"], res["total"]["not_exercised"]) == (2, 2, 0)
  assert set(res["areas"]["resilience"]["cases"]) == {"config_file_missing", "typo_in_key"}
  with open(campaign.COMMITTED, "rb") as f:
    assert f.read() == committed
  r = subprocess.run([sys.executable, "-m", "benchmarks.reliability", "--only", "typo_in_key", "--commit"],
                     cwd=harness.ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
      "--commit records the whole campaign: drop --only, --class, --fast and --area, or write a part with --out "
      "instead"), r.stderr
