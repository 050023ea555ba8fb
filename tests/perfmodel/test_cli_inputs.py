"""Command-line inputs of the performance model: bad --ranks values are one line, not a traceback
(perfmodel/emulate/cli.py), and --help lists the hardware profiles the code has (perfmodel/cli.py)."""
import os
import subprocess
import sys

import pytest

from perfmodel import cli as perf_cli
from perfmodel import hardware
from perfmodel.emulate import cli as emulate_cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("spec", ["8", "99", "-1", "abc", "0,,x", ","])
def test_bad_rank_lists_are_one_line(spec):
  with pytest.raises(SystemExit) as e:
    emulate_cli._ranks(spec, 8)
  msg = str(e.value.code)
  assert msg.startswith(f"--ranks {spec!r}: ") and "0..7" in msg and "\n" not in msg


def test_good_rank_lists():
  assert emulate_cli._ranks("auto", 8) is None
  assert emulate_cli._ranks("0,7,7, 3", 8) == [0, 7, 3]


def test_emulate_cli_refuses_a_bad_rank_before_any_work():
  r = subprocess.run([sys.executable, "-m", "perfmodel", "emulate", "--config",
                      "experiments/configs/quickstart.py:runlocal=True", "--ranks", "99", "--compile-only"],
                     cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=300)
  assert r.returncode != 0 and "Traceback" not in r.stderr
  assert r.stderr.strip().splitlines()[-1] == "--ranks '99': this mesh has 8 ranks, so ids run 0..7; pass ids in " \
                                              "that range or 'auto'"


def test_help_lists_every_hardware_profile():
  text = perf_cli._parser().format_help() + "".join(
      a.format_help() for a in perf_cli._parser()._subparsers._group_actions[0].choices.values())
  for name in hardware.available():
    assert name in text
  assert "tpu_v6e" in hardware.available() and "h200" in hardware.available()


def test_readme_hardware_lists_are_the_profiles():
  """Every `--hardware a|b|...` list in the READMEs names existing profiles; the predict command lists them all."""
  import re
  found = {}
  for rel in ("README.md", "perfmodel/README.md", "perfmodel/emulate/README.md"):
    with open(os.path.join(REPO, rel)) as f:
      for m in re.finditer(r"--hardware ((?:[a-z0-9_]+\|)+[a-z0-9_]+)", f.read()):
        found.setdefault(rel, []).append(m.group(1).split("|"))
  assert found
  for rel, lists in found.items():
    for names in lists:
      assert set(names) <= set(hardware.available()), (rel, names)
  assert set(found["perfmodel/README.md"][0]) == set(hardware.available())
