"""The PHOENIX/DeadPool and prima.cpp figures draw from the committed data alone (benchmarks/data/)."""
import os

import pytest

pytest.importorskip("matplotlib")

from experiments.figures import phoenix, primacpp, registry  # noqa: E402

OURS = [f for f in registry.FIGURES.values() if f.module in (phoenix.__name__, primacpp.__name__)]


def test_every_figure_is_registered():
  assert {f.name for f in OURS} == set(phoenix.DRAW) | set(primacpp.DRAW)
  assert {f.paper for f in OURS} == {"PHOENIX", "prima.cpp"}


@pytest.mark.parametrize("fig", OURS, ids=lambda f: f.name)
def test_draws_from_committed_data(tmp_path, fig):
  for p in fig.data_paths():
    assert os.path.exists(p), f"{fig.name} needs committed {p}"
  out = tmp_path / f"{fig.name}.png"
  summary = fig.draw(str(out))
  assert out.stat().st_size > 10_000
  assert summary["ours"] and fig.paper_number


def test_missing_data_names_the_command(tmp_path):
  with pytest.raises(registry.MissingData, match="benchmarks.hotswap"):
    phoenix.draw_recovery(str(tmp_path / "x.png"), data_dir=str(tmp_path))
  with pytest.raises(registry.MissingData, match="--rerun ksweep"):
    primacpp.draw_ring_k(str(tmp_path / "x.png"), data_dir=str(tmp_path))


def test_numbers_come_from_the_data():
  runs = phoenix._load(phoenix.RUNS)["quick"]
  recs = runs["B"]["recoveries"] + runs["C"]["recoveries"]
  assert all(r["kind"] in phoenix.KINDS for r in recs)  # every recovery lands in one kind's bar
  blk = phoenix._blocks(runs["A"]["step_log"])  # one median per 5-step block, on and off alternating
  assert abs(len(blk[True]) - len(blk[False])) <= 1 and len(blk[True]) >= 5


def test_halda_on_the_paper_devices_is_a_plan_not_a_copy():
  rows = primacpp.halda_paper_plans(primacpp.DATA)
  paper = primacpp._load(primacpp.PAPER)
  for name, r in rows.items():
    assert sum(r["w"]) * r["k"] == paper["not_in_the_paper"]["models"][name]["layers"]
    assert r["halda_ms"] != r["paper"]["prima.cpp"]
