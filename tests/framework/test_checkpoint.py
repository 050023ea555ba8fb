"""Checkpointer against bad workdirs: corrupt, partial and foreign checkpoints, an interrupted save.

Every case ends in a verified restore (of the newest good step, bad ones moved aside with their files intact)
or in a CheckpointError naming the fix; nothing is ever deleted."""
import asyncio
import gc
import glob
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from framework import checkpoint as ck
from framework.config import CheckpointConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(step, sharded=True):
  mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
  rng = np.random.default_rng(step)
  w = jax.device_put(jnp.asarray(rng.standard_normal((64, 40)), jnp.float32),
                     NamedSharding(mesh, P("d") if sharded else P()))
  return {"w": w, "b": {"x": jnp.asarray(rng.standard_normal(7), jnp.bfloat16)},
          "i": jnp.arange(5, dtype=jnp.int32) + step, "step": jnp.int32(step)}


def _abstract(state, sharded=True):
  mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
  sh = {"w": NamedSharding(mesh, P() if sharded else P("d"))}  # restore into the *other* layout
  return {k: (jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) if k in sh else
              jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), v))
          for k, v in state.items()}


def _same(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _workdir(tmp_path, steps=(2, 4)):
  c = ck.Checkpointer(str(tmp_path), CheckpointConfig(keep=10))
  for s in steps:
    c.save(s, _state(s), {"step": s})
  c.close()
  return str(tmp_path)


def _files(root):
  out = {}
  for p in glob.glob(os.path.join(root, "**"), recursive=True):
    if os.path.isfile(p) and not p.endswith("WHY.txt"):
      with open(p, "rb") as f:
        out[os.path.relpath(p, root)] = f.read()
  return out


def _biggest_data_file(step_dir):
  return max(glob.glob(os.path.join(step_dir, "state", "ocdbt.process_0", "d", "*")), key=os.path.getsize)


def _flip(step_dir):
  p = _biggest_data_file(step_dir)
  b = bytearray(open(p, "rb").read())
  b[len(b) // 2] ^= 0x01
  open(p, "wb").write(bytes(b))


def _truncate(step_dir):
  p = _biggest_data_file(step_dir)
  b = open(p, "rb").read()
  open(p, "wb").write(b[:len(b) // 2])


def _rm(rel):
  def f(step_dir):
    p = os.path.join(step_dir, rel)
    if os.path.isdir(p):
      import shutil
      shutil.rmtree(p)
    else:
      os.remove(p)
  return f


def _garbage(rel):
  return lambda step_dir: open(os.path.join(step_dir, rel), "w").write("{not json")


def _not_orbax(step_dir):
  import shutil
  shutil.rmtree(step_dir)
  os.makedirs(step_dir)
  open(os.path.join(step_dir, "notes.txt"), "w").write("a folder someone named like a step")


def test_checksum_is_layout_independent_and_catches_changes():
  s = _state(3)
  a = ck.state_checksum(s)
  assert a == ck.state_checksum({**s, "w": jax.device_put(s["w"], jax.devices()[0])})  # other sharding, same sums
  w = np.asarray(s["w"]).copy()
  w[5, 3] = np.nextafter(w[5, 3], np.float32(1e9))  # one ulp
  assert ck.state_checksum({**s, "w": jnp.asarray(w)}) != a
  w = np.asarray(s["w"]).copy()
  w[[1, 2]] = w[[2, 1]]  # same values, swapped rows: the position-weighted sum differs
  assert ck.state_checksum({**s, "w": jnp.asarray(w)}) != a


def test_restore_verifies_into_another_layout(tmp_path):
  wd = _workdir(tmp_path)
  c = ck.Checkpointer(wd, CheckpointConfig())
  state, data = c.restore(_abstract(_state(4)))
  c.close()
  assert _same(state, _state(4)) and data == {"step": 4}  # the integrity record is not handed back
  assert state["w"].sharding.spec == P()


@pytest.mark.parametrize("mutate", [_flip, _truncate, _rm("state/_METADATA"), _garbage("state/_METADATA"),
                                    _rm("data"), _rm("state/manifest.ocdbt"), _rm("state/ocdbt.process_0"),
                                    _not_orbax],
                         ids=["flipped_bit", "truncated_data", "no_METADATA", "garbage_METADATA", "no_data_item",
                              "no_manifest", "no_process_data", "not_orbax"])
def test_bad_latest_step_falls_back_and_is_kept_aside(tmp_path, mutate, caplog):
  wd = _workdir(tmp_path)
  mutate(os.path.join(wd, "checkpoints", "4"))
  before = _files(os.path.join(wd, "checkpoints", "4"))
  c = ck.Checkpointer(wd, CheckpointConfig(keep=10))
  state, data = c.restore(_abstract(_state(2)))
  assert _same(state, _state(2)) and data["step"] == 2
  assert "moved to" in caplog.text and "resumed from checkpoint step 2" in caplog.text
  moved = os.path.join(wd, ck.BAD_DIR, "4")
  assert _files(moved) == before and "WHY.txt" in os.listdir(moved)  # nothing lost, the reason recorded
  c.save(4, _state(4), {"step": 4})  # the step number is free again: orbax would otherwise skip it
  c.close()
  c = ck.Checkpointer(wd, CheckpointConfig())
  assert c.latest_step() == 4 and _same(c.restore(_abstract(_state(4)))[0], _state(4))
  c.close()


def _unretrieved_task_failure(filename):
  """A task whose coroutine (compiled as if it lived in ``filename``) fails and is freed unawaited: what orbax's
  sibling shard reads become when one read of a bad step fails first."""
  ns = {}
  exec(compile("async def read():\n  raise ValueError('Truncated Zstd-compressed stream')\n", filename, "exec"), ns)
  loop = asyncio.new_event_loop()
  try:
    task = loop.create_task(ns["read"]())
    loop.run_until_complete(asyncio.sleep(0))
    del task
    gc.collect()
  finally:
    loop.close()


def test_orbax_tasks_freed_after_a_failed_read_are_not_logged(caplog):
  ck._install_noise_filters()
  _unretrieved_task_failure("/site-packages/orbax/checkpoint/_src/serialization/serialization.py")
  assert not [r for r in caplog.records if r.name == "asyncio"]
  _unretrieved_task_failure("/elsewhere/user_code.py")  # anyone else's lost failure is still reported
  assert [r for r in caplog.records if r.name == "asyncio" and "never retrieved" in r.getMessage()]


def test_nothing_restorable_is_one_error_and_nothing_moves(tmp_path):
  wd = _workdir(tmp_path)
  for s in (2, 4):
    _flip(os.path.join(wd, "checkpoints", str(s)))
  before = _files(wd)
  c = ck.Checkpointer(wd, CheckpointConfig())
  with pytest.raises(ck.CheckpointError, match="can be restored.*step 4: checksum mismatch.*fresh --workdir") as e:
    c.restore(_abstract(_state(2)))
  c.close()
  assert e.value.kind == "corrupt" and _files(wd) == before


@pytest.mark.parametrize("what", ["shape", "tree", "dtype"])
def test_foreign_checkpoint_is_named_not_restored(tmp_path, what):
  wd = _workdir(tmp_path)
  want = _abstract(_state(2))
  if what == "shape":
    want["w"] = jax.ShapeDtypeStruct((64, 41), jnp.float32, sharding=want["w"].sharding)
  elif what == "tree":
    want["w2"] = want.pop("w")
  else:
    want["i"] = jax.ShapeDtypeStruct((5,), jnp.float32, sharding=want["i"].sharding)
  before = _files(wd)
  c = ck.Checkpointer(wd, CheckpointConfig())
  with pytest.raises(ck.CheckpointError, match="another model or state layout.*(fresh --workdir)") as e:
    c.restore(want)
  c.close()
  assert e.value.kind == "foreign" and _files(wd) == before
  assert {"shape": "(64, 41)", "tree": "'w2'", "dtype": "int32"}[what] in str(e.value)


def test_checkpoints_path_is_a_file(tmp_path):
  (tmp_path / "checkpoints").write_text("not a folder")
  with pytest.raises(ck.CheckpointError, match="not a directory.*another --workdir"):
    ck.Checkpointer(str(tmp_path), CheckpointConfig())
  assert (tmp_path / "checkpoints").read_text() == "not a folder"


def test_interrupted_save_is_ignored_and_cleaned(tmp_path):
  wd = _workdir(tmp_path)
  os.rename(os.path.join(wd, "checkpoints", "4"), os.path.join(wd, "checkpoints", "6.orbax-checkpoint-tmp"))
  assert ck.step_dirs(os.path.join(wd, "checkpoints")) == [2]
  c = ck.Checkpointer(wd, CheckpointConfig())
  assert c.latest_step() == 2 and _same(c.restore(_abstract(_state(2)))[0], _state(2))
  c.close()
  assert not glob.glob(os.path.join(wd, "checkpoints", "*tmp*"))  # an incomplete save is not data


_SAVER = r"""
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, sys.argv[2])
import jax, jax.numpy as jnp, numpy as np
from framework import checkpoint as ck
from framework.config import CheckpointConfig
c = ck.Checkpointer(sys.argv[1], CheckpointConfig(keep=100))
for s in range(1, 1000):
  st = {"w": jnp.full((1 << 22,), s, jnp.float32), "v": jnp.arange(1 << 20, dtype=jnp.int32) * s}
  c.save(s, st, {"step": s})
  print("saving", s, flush=True)
  c.wait()
  print("committed", s, flush=True)
"""


@pytest.mark.parametrize("delay", [0.05])
def test_sigkill_during_async_save_resumes_from_committed_step(tmp_path, delay):
  """A process SIGKILLed while its async save writes: the step in flight never shows up as a step, and the
  newest step listed restores and verifies (the previous committed one, or the one in flight if it finished)."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path), REPO], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, env=env, text=True)
  committed, in_flight = [], None
  try:
    for line in proc.stdout:
      what, s = line.split()
      if what == "committed":
        committed.append(int(s))
      elif int(s) >= 3:
        in_flight = int(s)
        time.sleep(delay)
        break
  finally:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
  assert in_flight is not None and committed, "the saver did not get going"
  c = ck.Checkpointer(str(tmp_path), CheckpointConfig())
  latest = c.latest_step()
  assert latest in (committed[-1], in_flight), (latest, committed, in_flight)
  mesh_free = {"w": jax.ShapeDtypeStruct((1 << 22,), jnp.float32, sharding=NamedSharding(
      Mesh(np.array(jax.devices()[:1]), ("d",)), P())),
      "v": jax.ShapeDtypeStruct((1 << 20,), jnp.int32, sharding=NamedSharding(Mesh(np.array(jax.devices()[:1]),
                                                                                      ("d",)), P()))}
  state, data = c.restore(mesh_free)
  c.close()
  assert data["step"] == latest and float(state["w"][0]) == latest and int(state["v"][1]) == latest
  assert not glob.glob(os.path.join(str(tmp_path), "checkpoints", "*tmp*"))
