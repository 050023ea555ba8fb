"""`python -m experiments.figures` draws every registered paper figure from committed data, fast.

Runs the real command once in a subprocess into a temporary folder (--out-dir), then checks per figure that it
wrote a non-empty PNG and reported our number. A figure may be undrawn only when one of its data files is not
committed; that figure alone is skipped, naming the file.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from experiments.figures import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIGURES = registry.discover()


def _run(*args, timeout=90):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
             MPLBACKEND="Agg")
  return subprocess.run([sys.executable, "-m", "experiments.figures", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
  out = tmp_path_factory.mktemp("figures")
  t0 = time.perf_counter()
  p = _run("--out-dir", str(out))
  wall = time.perf_counter() - t0
  assert p.returncode == 0, p.stderr[-3000:]
  return out, json.loads(p.stdout.strip().splitlines()[-1]), wall


def test_the_whole_set_is_fast_and_complete(drawn):
  _, summary, wall = drawn
  assert set(summary) == set(FIGURES), (sorted(summary), sorted(FIGURES))
  assert wall < 60, f"drawing every figure took {wall:.0f} s (limit 60 s here, 2 min for users)"


@pytest.mark.parametrize("name", list(FIGURES))
def test_figure(drawn, name):
  out, summary, _ = drawn
  fig = FIGURES[name]
  assert fig.paper_number and fig.rerun, f"{name} needs its paper's number and a rerun command"
  absent = [rel for rel in fig.data if not os.path.exists(os.path.join(ROOT, rel))]
  if absent:
    assert "missing" in summary[name], summary[name]
    pytest.skip(f"{name}: data not committed yet: {', '.join(absent)} ({summary[name]['missing']})")
  png = out / f"{name}.png"
  assert png.exists() and png.stat().st_size > 1000, (name, summary[name])
  assert summary[name]["ours"], f"{name} returned no summary of our number"


def test_list_and_unknown_name():
  p = _run("--list")
  assert p.returncode == 0, p.stderr[-2000:]
  for name in FIGURES:
    assert name in p.stdout
  bad = _run("--only", "no_such_figure")
  assert bad.returncode != 0 and "unknown figure" in bad.stderr


def test_rerun_runs_the_command_with_this_interpreter_then_draws(tmp_path, monkeypatch):
  from experiments.figures import __main__ as runner
  marker = tmp_path / "python.txt"
  cmd = f"python -c \"import sys; open({str(marker)!r}, 'w').write(sys.prefix)\""

  def draw(out):
    with open(out, "wb") as f:
      f.write(b"\x89PNG" + b"0" * 2000)
    return {"ours": "drawn"}
  fig = registry.Figure("rerun_probe", "none", draw, "unused.png", [], cmd, "-", __name__)
  monkeypatch.setitem(registry.FIGURES, "rerun_probe", fig)
  monkeypatch.setattr(registry, "discover", lambda: registry.FIGURES)
  assert runner.main(["--rerun", "rerun_probe", "--out-dir", str(tmp_path)]) == 0
  assert marker.read_text() == sys.prefix  # the same environment (a venv has its own prefix)
  assert (tmp_path / "rerun_probe.png").stat().st_size > 1000
