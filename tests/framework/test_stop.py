"""Stopping on a signal and a full disk, in process (framework/stop.py, framework/train.py, framework/checkpoint.py).

The same behaviours end to end, through ``python -m experiments.run`` in subprocesses (random steps, a second
signal, ``--processes 2``, a real size-capped tmpfs): benchmarks/reliability/lifecycle_cases.py, run
by tests/resilience/test_faults.py and ``python -m benchmarks.reliability``.
"""
import json
import os
import signal

import pytest

from framework import checkpoint as ckpt_lib
from framework import stop as stop_lib
from framework import train
from parallelism.step import build_on_devices
from tests.framework.tiny import tiny_config

STEPS = 8


def _losses(workdir) -> dict:
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if "loss" in r:
        out.setdefault(r["step"], []).append(r["loss"])
  return out


def _signal_at(step: int, sig: int):
  """A ``build`` whose compiled step sends ``sig`` to this process while it computes step ``step``."""
  def build(cfg):
    obj = build_on_devices(cfg)
    real = obj.__class__.__call__

    class Signalling(obj.__class__):
      def __call__(self, state, batch):
        n = int(state.step) + 1  # before the call: it donates `state`
        out = real(self, state, batch)
        if n == step:
          os.kill(os.getpid(), sig)
        return out
    obj.__class__ = Signalling
    return obj
  return build


def _cfg():
  return tiny_config(checkpoint=dict(every=100, keep=5), train=dict(steps=STEPS))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted run's losses by step."""
  wd = tmp_path_factory.mktemp("reference")
  train.train_and_evaluate(_cfg(), str(wd), build=build_on_devices)
  return _losses(wd)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_that_step_and_the_resume_is_bit_identical(tmp_path, sig, reference):
  cfg = _cfg()
  wd = tmp_path / "stopped"
  old = signal.getsignal(sig)
  with pytest.raises(stop_lib.Stopped) as e:
    train.train_and_evaluate(cfg, str(wd), build=_signal_at(3, sig))
  assert signal.getsignal(sig) is old  # handlers restored
  s = e.value
  assert (s.signum, s.step, s.exit_code) == (sig, 3, 130 if sig == signal.SIGINT else 0)
  assert s.checkpoint == os.path.join(ckpt_lib.checkpoint_dir(str(wd)), "3")
  assert str(s).startswith(f"stopped by {signal.Signals(sig).name} after step 3; checkpoint saved in {s.checkpoint}")
  assert "run the same command again" in str(s) and "\n" not in str(s)
  assert ckpt_lib.step_dirs(ckpt_lib.checkpoint_dir(str(wd))) == [3]
  assert ckpt_lib.quick_check(ckpt_lib.checkpoint_dir(str(wd)), 3) is None
  assert sorted(_losses(wd)) == [1, 2, 3]
  train.train_and_evaluate(cfg, str(wd), build=build_on_devices)  # the rerun
  got, want = _losses(wd), reference
  assert sorted(got) == list(range(1, STEPS + 1))
  for step, losses in got.items():
    assert losses == want[step] * len(losses), step  # bit-identical, before and after the stop


def test_full_disk_is_one_error_partial_removed_earlier_kept(tmp_path, monkeypatch):
  """Stand-in for a full disk where no size-capped tmpfs can be mounted: orbax's save of step 4 fails the way
  tensorstore reports ENOSPC, after leaving its temp folder (the tmpfs case: benchmarks/reliability/lifecycle_cases.py)."""
  import orbax.checkpoint as ocp
  cfg2 = tiny_config(checkpoint=dict(every=2, keep=5), train=dict(steps=2))
  wd = str(tmp_path / "wd")
  train.train_and_evaluate(cfg2, wd, build=build_on_devices)
  ck = ckpt_lib.checkpoint_dir(wd)
  before = {p: open(os.path.join(d, p), "rb").read() for d, _, fs in os.walk(os.path.join(ck, "2")) for p in fs}
  real_save = ocp.CheckpointManager.save

  def full_disk(self, step, *a, **k):
    if step == 4:
      os.makedirs(os.path.join(str(self.directory), f"{step}.orbax-checkpoint-tmp-1", "state"))
      raise ValueError(f'RESOURCE_EXHAUSTED: Error writing local file "{self.directory}/4.orbax-checkpoint-tmp-1/'
                       f'state/_sharding": Failed to write 3274 bytes: No space left on device [os_error_code=\'28\']')
    return real_save(self, step, *a, **k)
  monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
  with pytest.raises(ckpt_lib.CheckpointError) as e:
    train.train_and_evaluate(tiny_config(checkpoint=dict(every=2, keep=5), train=dict(steps=4)), wd,
                             build=build_on_devices)
  msg = str(e.value)
  assert e.value.kind == "io" and "\n" not in msg
  assert msg.startswith(f"no space left on device while saving checkpoint step 4 in {ck}: free space there")
  assert "resume from step 2" in msg and "complete checkpoints [2] are kept" in msg
  assert ckpt_lib.partial_saves(ck) == [] and ckpt_lib.step_dirs(ck) == [2]
  after = {p: open(os.path.join(d, p), "rb").read() for d, _, fs in os.walk(os.path.join(ck, "2")) for p in fs}
  assert after == before


def test_disk_full_recognises_the_forms_it_takes():
  assert ckpt_lib.disk_full(OSError(28, "No space left on device"))
  assert ckpt_lib.disk_full(ValueError("RESOURCE_EXHAUSTED: ... [os_error_code='28']"))
  wrapped = RuntimeError("save failed")
  wrapped.__cause__ = OSError(122, "Disk quota exceeded")
  assert ckpt_lib.disk_full(wrapped)
  assert not ckpt_lib.disk_full(ValueError("RESOURCE_EXHAUSTED: out of memory"))
  assert not ckpt_lib.disk_full(OSError(13, "Permission denied"))
