"""TensorBoard scalars beside metrics.jsonl and a profiler trace of chosen steps (framework/observe.py), from one
tiny training run through the one loop."""
import glob
import gzip
import json
import os
import struct

import pytest

from framework import config as config_lib
from framework import config_file
from framework import optim
from framework import train
from parallelism.step import build_on_devices
from tests.framework.tiny import tiny_config

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
QUICK = os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "configs", "quickstart.py") + ":runlocal=True"


def _events(logdir: str) -> list:
  """Every Event of the TFRecord files in ``logdir`` (8-byte length, 4-byte CRC, payload, 4-byte CRC)."""
  out = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      ev = event_pb2.Event()
      ev.ParseFromString(data[i + 12:i + 12 + n])
      out.append(ev)
      i += 12 + n + 4
  return out


def _scalars(logdir: str) -> dict:
  """{(tag, step): value} of the scalar summaries in ``logdir``."""
  return {(v.tag, ev.step): v.simple_value for ev in _events(logdir) if ev.HasField("summary")
          for v in ev.summary.value}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("observe")
  cfg = tiny_config(train=dict(steps=4, log_every=1, profile_steps=(1, 2)))
  summary = train.train_and_evaluate(cfg, str(workdir), build=build_on_devices)
  return workdir, summary


def test_tensorboard_scalars_are_the_metrics_records(run):
  workdir, _ = run
  recs = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  want = {(k, r["step"]): float(v) for r in recs for k, v in r.items()
          if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
  got = _scalars(str(workdir / "tensorboard"))
  assert set(got) == set(want)
  for key, v in want.items():
    assert got[key] == pytest.approx(v, rel=1e-6), key  # float32 in the event file
  tags = {t for t, _ in got}
  assert {"loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu"} <= tags
  lrs = [got[("lr", s)] for s in (2, 3, 4)]
  assert 0 < lrs[0] < lrs[1] < lrs[2]  # warmup of 5 steps: the rate rises


def test_lr_is_the_schedules_rate_of_the_logged_update(run):
  workdir, _ = run
  cfg = tiny_config()
  sched = optim.schedule(cfg.optim, cfg.train.steps)
  recs = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if "lr" in line]
  assert [r["step"] for r in recs] == [2, 3, 4]
  assert [r["lr"] for r in recs] == pytest.approx([float(sched(s - 1)) for s in (2, 3, 4)])
  # the warmup is linear from 0 over 5 steps to optim.lr=1e-2: the update of step 2 uses 1/5 of it
  assert recs[0]["lr"] == pytest.approx(1e-2 * 1 / 5)


def test_profile_steps_write_a_trace(run):
  workdir, _ = run
  xplane = glob.glob(str(workdir / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
  traces = glob.glob(str(workdir / "profile" / "plugins" / "profile" / "*" / "*.trace.json.gz"))
  assert len(xplane) == 1 and os.path.getsize(xplane[0]) > 0
  assert len(traces) == 1
  with gzip.open(traces[0], "rt") as f:
    events = json.load(f)["traceEvents"]
  assert any(e.get("ph") == "X" for e in events)  # timed events, not only metadata


def test_tensorboard_off_writes_no_event_files(tmp_path):
  cfg = tiny_config(train=dict(steps=1, tensorboard=False))
  train.train_and_evaluate(cfg, str(tmp_path), build=build_on_devices)
  assert (tmp_path / "metrics.jsonl").exists()
  assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "profile").exists()


@pytest.mark.parametrize("value", ["5", "(1,0)", "(-1,2)", "1,2,3"])
def test_bad_profile_steps_is_one_clear_error(value):
  cfg = config_file.load(QUICK, [f"--config.train.profile_steps={value}"])
  with pytest.raises(config_lib.ConfigError, match="must be START,COUNT"):
    config_lib.validate(cfg, 8)


def test_profile_steps_override_parses_to_a_tuple():
  cfg = config_file.load(QUICK, ["--config.train.profile_steps=3,2"])
  assert cfg.train.profile_steps == (3, 2)
