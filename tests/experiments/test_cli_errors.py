"""The entry point turns a full disk into one line, wherever it surfaces (orbax reports a writer thread's ENOSPC
as a ValueError carrying tensorstore's RESOURCE_EXHAUSTED text), and removes the partial saves it left."""
import os

import pytest

from experiments import run


def _raiser(exc):
  def main(argv):
    raise exc
  return main


def test_a_full_disk_from_orbax_is_one_line_and_partial_saves_go(monkeypatch, tmp_path, capsys):
  wd = tmp_path / "wd"
  partial = wd / "checkpoints" / "4.orbax-checkpoint-tmp-1733"
  partial.mkdir(parents=True)
  (partial / "shard").write_bytes(b"x" * 10)
  (wd / "checkpoints" / "2").mkdir()
  err = ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left on device [os_error_code='28']")
  monkeypatch.setattr(run, "main", _raiser(err))
  rc = run.cli(["--config", "experiments/configs/quickstart.py", "--workdir", str(wd)])
  out = capsys.readouterr().err.strip().splitlines()
  assert rc == 5
  assert len(out) == 1 and "no space left on device" in out[0] and "4.orbax-checkpoint-tmp-1733" in out[0]
  assert not partial.exists() and (wd / "checkpoints" / "2").is_dir()


def test_other_errors_still_raise(monkeypatch, tmp_path):
  monkeypatch.setattr(run, "main", _raiser(ValueError("a bug, not the disk")))
  with pytest.raises(ValueError, match="a bug"):
    run.cli(["--config", "x.py", f"--workdir={tmp_path}"])
  assert os.listdir(tmp_path) == []
