"""Fast, single-process tests: shared-memory slots, snapshot layout, injection plans, goodput model."""
import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from framework.config import ConfigError
from resilience import goodput, injection, layout, settings, slots


def test_slots_double_buffer_protects_committed(tmp_path):
  f = slots.SlotFile(str(tmp_path / "own"), 1000, create=True)
  g = slots.SlotFile(str(tmp_path / "own"), 1000, create=False)  # the worker's mapping of the agent's file
  g.view(0, 1000)[:] = 7
  assert (f.view(0, 1000) == 7).all()  # same memory
  f.meta[0] = slots.SlotMeta(version=3, nbytes=1000, crc=slots.checksum(f.view(0, 1000)), complete=True)
  assert f.verify(0)
  assert f.slot_for_write(protect_version=3) == 1
  f.meta[1] = slots.SlotMeta(version=4, nbytes=1000, crc=0, complete=True)
  assert f.slot_for_write(protect_version=4) == 0  # v4 committed: v3 may go
  assert f.slot_for_write(protect_version=3) == 1  # v4 not committed (e.g. after a failure): keep v3
  f.view(0, 1000)[5] = 8
  assert not f.verify(0)  # checksum catches corruption
  g.close()
  f.close(unlink=True)
  assert not os.path.exists(tmp_path / "own")


def test_layout_roundtrip_sharded_state():
  devs = np.array(jax.devices()[:8])
  mesh = Mesh(devs, ("fsdp",))
  state = {"w": jax.device_put(jnp.arange(64 * 3, dtype=jnp.float32).reshape(64, 3), NamedSharding(mesh, P("fsdp"))),
           "b": jax.device_put(jnp.ones((5,), jnp.bfloat16), NamedSharding(mesh, P())),
           "step": jax.device_put(jnp.int32(7), NamedSharding(mesh, P()))}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  lay = layout.make(abstract)
  # 8 shards of w (8x3 f32) + 8 replicated copies of b and of step (one per local device)
  assert len(lay.pieces) == 24 and all(p.offset % 64 == 0 for p in lay.pieces)
  buf = np.zeros(lay.nbytes, np.uint8)
  layout.pack(state, lay, buf)
  back = layout.unpack(buf, lay)
  for k in state:
    assert back[k].sharding == state[k].sharding
    np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(state[k]))
  buf[:] = 0  # restored arrays must not alias shared memory
  assert int(back["step"]) == 7


def test_injection_plan_parses_overrides():
  s = settings.from_dict({"fail_at": "5,9", "fail_kind": "node,hang", "fail_rank": 2})
  p = injection.plan(s, 20)
  assert [(f.at_step, f.kind, f.rank) for f in p] == [(5, "node", 2), (9, "hang", 2)]
  s = settings.from_dict({"fail_at": -1, "fail_kind": "random", "fail_seed": 3})
  a, b = injection.plan(s, 30), injection.plan(s, 30)
  assert [(f.at_step, f.kind, f.rank) for f in a] == [(f.at_step, f.kind, f.rank) for f in b]
  assert 2 <= a[0].at_step < 30 and a[0].kind in settings.FAIL_KINDS
  camp = injection.random_campaign(20, 200, 4, 2, seed=0)
  plan = injection.plan(settings.from_dict({**camp, "replicas": 2}), 200)
  assert len(plan) == 20 and len({f.at_step for f in plan}) == 20


def test_settings_reject_typos_and_bad_kinds():
  with pytest.raises(ConfigError, match="unknown extras.resilience"):
    settings.from_dict({"fail_att": 3})
  with pytest.raises(ConfigError, match="fail_kind"):
    settings.from_dict({"fail_kind": "meteor"})
  with pytest.raises(ConfigError, match="replicas"):
    settings.from_dict({"nodes": 2, "replicas": 2})


def test_goodput_segment_formula_matches_monte_carlo():
  """E[w] = e^{lam R}(e^{lam w}-1)/lam: work w redone after each failure, restart R (itself interruptible)."""
  rng = random.Random(0)
  lam, w, r = 1 / 50.0, 20.0, 5.0
  total, n = 0.0, 40000
  for _ in range(n):
    t = 0.0
    while True:
      x = rng.expovariate(lam)
      if x >= w:
        t += w
        break
      t += x
      while True:  # restart; a failure during it restarts the restart
        y = rng.expovariate(lam)
        if y >= r:
          t += r
          break
        t += y
    total += t
  model = goodput.expected_segment_s(w, r, lam)
  assert abs(total / n - model) / model < 0.02, (total / n, model)
  # failures only while working (the benchmark's injector): no failure inside the restart loop
  total = 0.0
  for _ in range(n):
    t = 0.0
    while True:
      x = rng.expovariate(lam)
      if x >= w:
        t += w
        break
      t += x + r
    total += t
  model = goodput.expected_segment_s(w, r, lam, fail_during_restart=False)
  assert abs(total / n - model) / model < 0.02, (total / n, model)


def test_goodput_orders_strategies_sensibly():
  c = goodput.Costs(step_s=1.0, nodes=512, node_mtbf_s=512 * 3600.0, spares=8, disk_save_s=30, disk_restart_s=600,
                    mem_overhead_ratio=1.01, mem_restart_s=300, hotswap_overhead_ratio=1.01, hotswap_recovery_s=30)
  g = goodput.predict(c)["goodput"]
  assert g["hotswap"] > g["in_memory_restart"] > g["disk_checkpoint_restart"]
  assert g["hotswap"] < 1 / 1.01
  no_fail = goodput.predict(goodput.Costs(step_s=1.0, nodes=4, node_mtbf_s=1e15, hotswap_overhead_ratio=1.02))
  assert no_fail["goodput"]["hotswap"] == pytest.approx(1 / 1.02, rel=1e-6)


@pytest.mark.parametrize("d,match", [
    ({"nodes": "abc"}, "nodes must be int"), ({"persist_every": -1}, "persist_every=-1 is out of range"),
    ({"spares": -1}, "spares=-1"), ({"heartbeat_timeout_s": 0}, "heartbeat_timeout_s=0.0"),
    ({"snapshot": "yes"}, "snapshot must be bool"), ({"fail_at": "x"}, "fail_at='x' must be a step"),
    ({"fail_at": "3,4", "fail_kind": "node,hang,worker"}, "3 entries for 2 fail_at"), ({"fail_rank": 4}, "< nodes=4"),
    ({"heartbeat_s": 3.0}, "must exceed heartbeat_s"), ({"fail_at": -3}, ">= 0")])
def test_settings_reject_wrong_types_and_ranges(d, match):
  with pytest.raises(ConfigError, match=match):
    settings.from_dict(d)
  assert settings.from_dict({"nodes": 3.0, "heartbeat_s": 1}).nodes == 3  # integral float / int widened: fine


def test_workdir_lock_and_sweep_touch_only_this_workdir(tmp_path, monkeypatch):
  from framework.workdir import WorkdirError
  from resilience import launch
  from tests.framework.test_workdir import hold_lock
  shm = tmp_path / "shm"
  shm.mkdir()
  monkeypatch.setattr(slots, "shm_dir", lambda: str(shm))
  monkeypatch.setattr(launch, "LOCK_WAIT_S", 0.3)
  wd = tmp_path / "wd"
  wd.mkdir()
  (wd / "run_id").write_text("aaaa1\n")
  for name in ("prismllm-aaaa1-node0-own", "prismllm-aaaa1-node1-rep0", "prismllm-bbbb2-node0-own"):
    (shm / name).write_bytes(b"x")
  with hold_lock(str(wd)) as holder:  # another launcher, alive
    with pytest.raises(WorkdirError, match=f"in use by another hot-swap run: pid {holder.pid} .*another --workdir"):
      launch.lock_workdir(str(wd))
  lock = launch.lock_workdir(str(wd))  # free again once the holder is gone
  try:
    removed = launch.sweep_stale(str(wd))
  finally:
    lock.release()
  assert sorted(os.path.basename(p) for p in removed) == ["prismllm-aaaa1-node0-own", "prismllm-aaaa1-node1-rep0"]
  assert os.listdir(shm) == ["prismllm-bbbb2-node0-own"]  # another job's segment is never touched


def test_goodput_schedule_prediction_adds_measured_costs():
  base = goodput.predict_schedule(0.5, 101, [], {}, {}, plain_step_s=0.4)
  assert base["wall_s"] == pytest.approx(50.0) and base["goodput"] == pytest.approx(101 * 0.4 / 50.0)
  one = goodput.predict_schedule(0.5, 101, ["node"], {"node": 7.0}, {"node": 2}, plain_step_s=0.4)
  assert one["wall_s"] == pytest.approx(50.0 + 7.0 + 0.5)  # recovery + the one extra recomputed step
  unk = goodput.predict_schedule(0.5, 101, ["hang"], {"node": 7.0, "worker": 3.0}, {"node": 1, "worker": 1}, 0.4)
  assert unk["wall_s"] == pytest.approx(55.0) and unk["unmeasured_kinds"] == ["hang"]  # median of the measured


def test_goodput_vs_mtbf_orders_strategies_and_keeps_sources():
  d = {"nodes": 4, "spares": 1, "measured_costs": {
      "step_s": {"value": 0.3, "source": "A"}, "hotswap_overhead_ratio": {"value": 1.05, "source": "A x P"},
      "hotswap_recovery_s": {"value": 5.0, "source": "C"}, "mem_overhead_ratio": {"value": 1.03, "source": "A"},
      "mem_restart_s": {"value": 30.0, "source": "C + R"}, "disk_save_s": {"value": 0.5, "source": "P"},
      "disk_restart_s": {"value": 35.0, "source": "C + R"}}}
  c = goodput.costs_from_benchmark(d, node_mtbf_s=3600.0)
  assert dict(c.sources)["hotswap_recovery_s"] == "C" and c.disk_restart_s == 35.0
  rows = goodput.goodput_vs_mtbf(c, [120.0, 3600.0, 1e9])
  assert [r["node_mtbf_s"] for r in rows] == [120.0, 3600.0, 1e9]
  assert rows[0]["goodput_hotswap"] > rows[0]["goodput_in_memory_restart"] > rows[0]["goodput_disk_checkpoint_restart"]
  assert all(a["goodput_hotswap"] < b["goodput_hotswap"] for a, b in zip(rows, rows[1:]))  # fewer failures: better
  assert rows[-1]["goodput_hotswap"] == pytest.approx(1 / 1.05, rel=1e-4)
