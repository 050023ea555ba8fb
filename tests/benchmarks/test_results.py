"""benchmarks/RESULTS.md is what ``python -m benchmarks.results`` renders from benchmarks/data: the committed file
matches the committed data, a changed data file makes ``--check`` fail, and data files of another shape render the
fields they have instead of crashing the generator."""
import json
import os
import shutil

import pytest

from benchmarks import results

DATA = results.DATA


@pytest.fixture
def copy(tmp_path):
  """The committed data files (not the published programs) and a RESULTS.md rendered from them, in tmp_path."""
  data = tmp_path / "data"
  data.mkdir()
  for name in os.listdir(DATA):
    if name.endswith(".json"):
      shutil.copy(os.path.join(DATA, name), data / name)
  out = tmp_path / "RESULTS.md"
  assert results.main(["--data", str(data), "--out", str(out)]) == 0
  return data, out


def _edit(path, fn):
  with open(path) as f:
    d = json.load(f)
  fn(d)
  with open(path, "w") as f:
    json.dump(d, f)


def test_the_committed_results_are_what_the_committed_data_gives(capsys):
  assert results.main(["--check"]) == 0, capsys.readouterr().err


def test_a_changed_data_file_fails_the_check(copy, capsys):
  data, out = copy
  assert results.main(["--check", "--data", str(data), "--out", str(out)]) == 0
  assert "**1.002**" in out.read_text()

  def slower(d):
    d["single"]["framework_over_plain"]["median"] = 1.25
  _edit(data / "train_step.json", slower)
  assert results.main(["--check", "--data", str(data), "--out", str(out)]) == 1
  err = capsys.readouterr().err
  assert "differs" in err and len(err.strip().splitlines()) == 1
  assert results.main(["--data", str(data), "--out", str(out)]) == 0
  assert "**1.250**" in out.read_text() and "**1.002**" not in out.read_text()
  assert results.main(["--check", "--data", str(data), "--out", str(out)]) == 0


def test_a_hand_edit_of_results_fails_the_check(copy):
  data, out = copy
  out.write_text(out.read_text() + "| extra | row |\n")
  assert results.main(["--check", "--data", str(data), "--out", str(out)]) == 1


def test_every_row_names_its_command_machine_and_date_from_the_data(copy):
  data, out = copy
  text = out.read_text()
  d = json.loads((data / "emulate_l70b.json").read_text())
  row = next(line for line in text.splitlines() if "emulate_l70b.json" in line)
  assert f"`{d['command']}`" in row and d["machine"] in row and d["date"] in row
  p = json.loads((data / "published_validation.json").read_text())
  row = next(line for line in text.splitlines() if "published_validation.json" in line)
  assert p["run_at"] in row and p["command"] in row


def test_accuracy_figures_sit_beside_their_baseline(copy):
  data, out = copy
  p = json.loads((data / "published_validation.json").read_text())
  row = next(line for line in out.read_text().splitlines() if "published_validation.json" in line)
  inc = p["scores"]["included"]
  assert f"MAPE **{inc['model']['mape_pct']:.1f}%**" in row
  assert f"included: MAPE {inc['baseline']['mape_pct']:.1f}%" in row


def test_other_shapes_render_what_they_have(copy):
  data, out = copy
  (data / "reliability.json").write_text(json.dumps({"campaigns": [1, 2], "summary": {"crashes": 0}, "cases": 7}))
  (data / "published_validation.json").write_text(json.dumps({"run_at": "T", "scores": {"included": {"n": 3}},
                                                              "new_score": 1.5}))
  _edit(data / "hotswap_full.json", lambda d: [d.pop(k) for k in ("recovery_time_s", "trajectory_identical")])
  assert results.main(["--data", str(data), "--out", str(out)]) == 0
  text = out.read_text()
  rel = next(line for line in text.splitlines() if "reliability.json" in line)
  pub = next(line for line in text.splitlines() if "published_validation.json" in line)
  hot = next(line for line in text.splitlines() if "hotswap_full.json" in line)
  assert "all areas" in rel  # the renderer copes with the fields it finds
  assert "included (3 rows): MAPE **n/a**" in pub and "| T |" in pub
  assert "recovery n/a s median" in hot
  (data / "reliability.json").write_text(json.dumps([1, 2, 3]))  # not even an object
  assert results.main(["--data", str(data), "--out", str(out)]) == 0
  assert "reliability.json" in out.read_text()


def test_a_missing_data_file_drops_its_row(copy):
  data, out = copy
  os.remove(data / "infer_search.json")
  assert results.main(["--data", str(data), "--out", str(out)]) == 0
  assert "infer_search.json" not in out.read_text() and "train_step.json" in out.read_text()


def test_what_the_recording_commands_write_renders(copy, monkeypatch):
  """``ondevice.bench --record`` and ``perfmodel validate --record`` write a data file with command, machine and
  date, and the next render shows that run (nothing is appended anywhere)."""
  from ondevice import bench
  from perfmodel.calib import validate
  data, out = copy
  res = json.loads((data / "ondevice_bench_single.json").read_text())["result"]
  res["threads_1"]["ratio_ours_over_llama_cpp_exact"] = 0.5
  bench.record("single", "python -m ondevice.bench --suite single --record", res,
               str(data / "ondevice_bench_single.json"))
  host = json.loads((data / "perfmodel_validate.json").read_text())
  for k in ("command", "machine", "date"):
    host.pop(k)
  host["mape"] = 42.0
  monkeypatch.setattr(validate, "RECORD_JSON", str(data / "perfmodel_validate.json"))
  validate._record(host, "python -m perfmodel validate --record --rounds 3")
  assert results.main(["--data", str(data), "--out", str(out)]) == 0
  lines = out.read_text().splitlines()
  single = next(line for line in lines if "ondevice_bench_single.json" in line)
  assert "**0.50x**" in single and "`python -m ondevice.bench --suite single --record`" in single
  assert json.loads((data / "ondevice_bench_single.json").read_text())["date"] in single
  one = next(line for line in lines if "(data/perfmodel_validate.json)" in line)
  assert "MAPE **42.00%**" in one and "`python -m perfmodel validate --record --rounds 3`" in one
