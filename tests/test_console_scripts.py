"""The console scripts setup.cfg installs (``pip install -e .``): ``prismllm`` and ``prismllm-ondevice`` list their
commands and hand each one's arguments to the same ``main`` as its ``python -m`` form."""
import os
import shutil
import subprocess
import sys

import pytest

from experiments import cli as prismllm_cli
from ondevice import cli as ondevice_cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO)


def _script(name: str) -> str:
  path = shutil.which(name)
  assert path, f"`{name}` is not on PATH: install the package (`pip install -e .`), which installs its console scripts"
  return path


def _run(argv: list) -> subprocess.CompletedProcess:
  return subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name,table", [("prismllm", prismllm_cli.COMMANDS),
                                        ("prismllm-ondevice", ondevice_cli.COMMANDS)])
def test_help_lists_every_command(name, table):
  r = _run([_script(name), "--help"])
  assert r.returncode == 0, r.stderr
  for command, (_, _, _, help_line) in table.items():
    assert f"  {command}" in r.stdout and help_line in r.stdout


@pytest.mark.parametrize("script,argv,module_argv", [
    ("prismllm", ["predict", "--help"], ["-m", "perfmodel", "predict", "--help"]),
    ("prismllm", ["train", "--help"], ["-m", "experiments.run", "--help"]),
    ("prismllm", ["emulate", "--help"], ["-m", "perfmodel", "emulate", "--help"]),
    ("prismllm-ondevice", ["bench", "--help"], ["-m", "ondevice.bench", "--help"]),
    ("prismllm-ondevice", ["export", "--help"], ["-m", "ondevice.export", "--help"]),
])
def test_a_command_is_its_python_m_form(script, argv, module_argv):
  got, want = _run([_script(script), *argv]), _run([sys.executable, *module_argv])
  assert got.returncode == want.returncode == 0, got.stderr
  assert got.stdout == want.stdout and got.stdout.startswith("usage:")


def test_an_unknown_command_is_one_line():
  r = _run([_script("prismllm"), "trian"])
  assert r.returncode == 2 and "Traceback" not in r.stderr
  assert r.stderr.strip() == ("prismllm: unknown command 'trian'; choose one of train, predict, validate, search, "
                              "floor, calibrate, emulate (`prismllm --help`)")
  r = _run([_script("prismllm-ondevice")])
  assert r.returncode == 2 and r.stderr.startswith("usage: prismllm-ondevice {run,serve,export,bench}")
