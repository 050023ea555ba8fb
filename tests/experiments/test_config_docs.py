"""Every command in an experiments/configs/*.py docstring runs as written, up to argument parsing.

Each ``python -m MODULE ...`` / ``python SCRIPT ...`` line of a config's docstring (backslash continuations
joined, a trailing ``> FILE`` dropped) is checked without running it:
- the module or script exists;
- its own argparse parser accepts the argv: the command's ``main`` runs with ``ArgumentParser.parse_known_args``
  replaced by one that parses and then stops the run, so flags are checked by the real parser (typos, missing
  required flags, bad choices fail here) and nothing is trained, measured or written;
- left-over arguments are ``--config.*`` overrides, and ``--config FILE[:ARG]`` plus those overrides load through
  ``framework.config_file.load`` (so ``:runlocal=True``, ``:layers=N``, ``:role=draft`` must be accepted by that
  config's ``get_config``);
- repository paths it reads exist, and a command that writes a committed file (a profile, a PNG, a data file)
  names that file in the same docstring, unless the command line opts out of the write.
And ``:runlocal=True`` either changes a config or is rejected by it; it is never silently ignored.
"""
import argparse
import contextlib
import importlib.util
import io
import os
import pathlib
import re
import runpy
import shlex
import sys

import pytest

from framework import config_file
from framework.config import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (REPO / "experiments" / "configs").glob("*.py") if p.name != "__init__.py")
TOP = ("benchmarks/", "experiments/", "perfmodel/", "ondevice/", "resilience/", "framework/", "parallelism/")

# Commands whose entry point has no argparse parser: how many arguments each takes.
NO_PARSER = {"experiments.figures.perfmodel_accuracy": 2}

# (command key, committed file it writes, the flag that makes a user command write it; None: a benchmark script,
# which records by default and says so).
WRITES = [
    ("perfmodel calibrate", "perfmodel/profiles/cpu.json", "--commit"),
    ("perfmodel validate", "benchmarks/data/perfmodel_validate.json", "--record"),
    ("perfmodel.emulate.gloo_calibration", "perfmodel/emulate/calibration/cpu_gloo.json", "--commit"),
    ("ondevice.bench", "benchmarks/data/ondevice_bench_", "--record"),
    ("benchmarks.emulate_validate", "benchmarks/data/emulate_validate.json", None),
    ("benchmarks.emulate_validate", "benchmarks/emulate_validate.png", None),
    ("benchmarks.emulate_scale", "benchmarks/data/emulate_l70b.json", None),
    ("benchmarks.hotswap", "benchmarks/data/hotswap_", None),
]


def commands(doc: str) -> list:
  """The argv lists (from the module or script on) of the ``python ...`` lines of a docstring."""
  text = re.sub(r"\\\n\s*", " ", doc)
  out = []
  for line in text.splitlines():
    line = line.strip()
    m = re.match(r"(?:PYTHONPATH=\S+\s+)?python3?\s+(.*)$", line)
    if not m:
      continue
    argv = shlex.split(m.group(1), comments=True)
    if ">" in argv:
      argv = argv[:argv.index(">")]
    out.append(argv[1:] if argv[0] == "-m" else argv)
  return out


def key(argv: list) -> str:
  """'perfmodel validate', 'ondevice.bench', 'benchmarks/x.py': what a command runs."""
  if argv[0] in ("perfmodel", "perfmodel.emulate") and len(argv) > 1 and not argv[1].startswith("-"):
    return f"perfmodel {argv[1]}"
  return argv[0]


def _docs() -> dict:
  out = {}
  for p in CONFIGS:
    spec = importlib.util.spec_from_file_location(f"_doc_{p.stem}", p)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out[p.name] = mod.__doc__ or ""
  return out


DOCS = _docs()
CASES = [pytest.param(name, argv, id=f"{name}:{i}") for name, doc in DOCS.items()
         for i, argv in enumerate(commands(doc))]


class _Parsed(Exception):
  def __init__(self, ns, rest, strict):
    super().__init__("parsed")
    self.ns, self.rest, self.strict = ns, rest, strict


@contextlib.contextmanager
def _parse_only(monkeypatch):
  """The outermost parse_known_args / parse_args call parses for real, then raises _Parsed (the command stops)."""
  real_known = argparse.ArgumentParser.parse_known_args
  depth = [0]
  strict = [False]

  def known(self, args=None, namespace=None):
    depth[0] += 1
    try:
      ns, rest = real_known(self, args, namespace)
    finally:
      depth[0] -= 1
    if depth[0] == 0:
      raise _Parsed(ns, rest, strict[0])
    return ns, rest

  def parse_args(self, args=None, namespace=None):
    strict[0] = depth[0] == 0
    return known(self, args, namespace)

  monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", known)
  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
  yield


def _run_main(argv: list):
  """Runs the command's entry point as ``python`` would, in this process; returns _Parsed."""
  saved_env, saved_argv = dict(os.environ), sys.argv
  try:
    if argv[0].endswith(".py"):
      sys.argv = argv
      runpy.run_path(str(REPO / argv[0]), run_name="__main__")
    else:
      sys.argv = [argv[0]] + argv[1:]
      runpy.run_module(argv[0], run_name="__main__", alter_sys=False)
  except _Parsed as p:
    return p
  finally:
    os.environ.clear()
    os.environ.update(saved_env)
    sys.argv = saved_argv
  raise AssertionError(f"{argv[0]} returned without parsing its arguments")


def _repo_paths(argv: list) -> list:
  vals = []
  for a in argv[1:]:
    vals.append(a.split("=", 1)[1] if a.startswith("--") and "=" in a else a)
  return [v.split(":")[0] for v in vals if v.startswith(TOP)]


def _check(name: str, argv: list, monkeypatch) -> None:
  """Fails (AssertionError / pytest.fail) unless ``argv`` parses as described in the module docstring."""
  target = argv[0]
  if target.endswith(".py"):
    assert (REPO / target).is_file(), f"{name}: {target} does not exist"
  else:
    assert importlib.util.find_spec(target) is not None, f"{name}: no module {target}"
  for p in _repo_paths(argv):
    assert (REPO / p).exists(), f"{name}: {' '.join(argv)}: {p} does not exist"
  if target in NO_PARSER:
    assert len(argv) - 1 == NO_PARSER[target], f"{name}: {target} takes {NO_PARSER[target]} arguments: {argv}"
    return
  err = io.StringIO()
  with _parse_only(monkeypatch), contextlib.redirect_stderr(err):
    try:
      parsed = _run_main(argv)
    except SystemExit as e:
      pytest.fail(f"{name}: `{' '.join(argv)}` is rejected by its parser (exit {e.code}): {err.getvalue()[-800:]}")
  if parsed.strict:
    assert not parsed.rest, f"{name}: unrecognised arguments {parsed.rest}"
  bad = [r for r in parsed.rest if not r.startswith("--config.")]
  assert not bad, f"{name}: unrecognised arguments {bad}"
  spec = getattr(parsed.ns, "config", None)
  if isinstance(spec, str) and spec.split(":")[0].endswith(".py"):
    config_file.load(spec, list(parsed.rest))  # raises on an unknown config argument or override key


@pytest.mark.parametrize("name,argv", CASES)
def test_docstring_command_parses(name, argv, monkeypatch):
  _check(name, argv, monkeypatch)


def test_commands_found():
  """The parser above sees commands in every config (a docstring format it cannot read fails here)."""
  for name, doc in DOCS.items():
    assert commands(doc), f"{name}: no `python ...` command in its docstring"


@pytest.mark.parametrize("name", sorted(DOCS))
def test_committed_writes_are_named(name):
  doc = DOCS[name]
  for argv in commands(doc):
    for k, path, opt_in in WRITES:
      if key(argv) == k and (opt_in is None or opt_in in argv):
        assert path in doc, f"{name}: `{' '.join(argv)}` writes the committed {path}; say so in the docstring"
    for flag in ("--png", "--out"):
      value = argv[argv.index(flag) + 1] if flag in argv[:-1] else None
      assert not (value and value.startswith(TOP) and "--record" not in argv and "--commit" not in argv), \
          f"{name}: {flag} {value} writes into the repository"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_runlocal_shrinks_or_is_rejected(path):
  base = config_file.load_configdict(str(path)).to_dict()
  try:
    local = config_file.load_configdict(f"{path}:runlocal=True").to_dict()
  except ConfigError as e:
    assert "\n" not in str(e), f"{path.name}: the rejection is one line"
    return
  assert local != base, f"{path.name}: ':runlocal=True' is accepted and ignored"


@pytest.mark.parametrize("argv", [
    ["ondevice.run", "--model", "/tmp/x.gguf", "--no-such-flag"],  # parse_args: an unknown flag
    ["experiments.run", "--config", "experiments/configs/quickstart.py", "--workdir", "/tmp/x", "--stray"],
    ["experiments.run", "--config", "experiments/configs/ondevice_big.py:size=small", "--workdir", "/tmp/x"],
    ["experiments.run", "--config", "experiments/configs/quickstart.py", "--workdir", "/tmp/x", "--config.train.stepz=3"],
    ["perfmodel", "predict", "--config", "experiments/configs/quickstart.py", "--hardwear", "h100"],
    ["ondevice.bench", "--model", "/tmp/x.gguf", "--suite", "ring", "--devices", "benchmarks/no_such.yaml"],
])
def test_check_rejects_a_broken_command(argv, monkeypatch):
  """The check fails commands that would not run (so a pass above means something)."""
  with pytest.raises((AssertionError, pytest.fail.Exception, ConfigError)):
    _check("broken", argv, monkeypatch)
