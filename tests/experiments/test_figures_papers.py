"""The PHOENIX/DeadPool and prima.cpp figures draw from the committed data alone (benchmarks/data/)."""
import os

import pytest

pytest.importorskip("matplotlib")

from experiments.figures import phoenix, primacpp  # noqa: E402


@pytest.mark.parametrize("name,fn,data", [(n, f, d) for n, _, f, d in phoenix.FIGURES + primacpp.FIGURES])
def test_draws_from_committed_data(tmp_path, name, fn, data):
  for d in data:
    assert os.path.exists(os.path.join(phoenix.DATA, d)), f"{name} needs committed benchmarks/data/{d}"
  out = tmp_path / f"{name}.png"
  summary = fn(str(out))
  assert out.stat().st_size > 10_000
  assert summary


def test_numbers_come_from_the_data():
  runs = phoenix._load(phoenix.RUNS)["quick"]
  # every recovery of runs B and C lands in one kind's bar
  n = sum(1 for r in runs["B"]["recoveries"] + runs["C"]["recoveries"] if r["kind"] in phoenix.KINDS)
  assert n == len(runs["B"]["recoveries"]) + len(runs["C"]["recoveries"])
  # the overhead boxes hold one median per 5-step block, on and off alternating
  blk = phoenix._blocks(runs["A"]["step_log"])
  assert abs(len(blk[True]) - len(blk[False])) <= 1 and len(blk[True]) >= 5


def test_halda_on_the_paper_devices_is_a_plan_not_a_copy():
  rows = primacpp.halda_paper_plans()
  paper = primacpp._load(primacpp.PAPER)
  for name, r in rows.items():
    assert sum(r["w"]) * r["k"] == paper["not_in_the_paper"]["models"][name]["layers"]
    assert r["halda_ms"] != r["paper"]["prima.cpp"]
