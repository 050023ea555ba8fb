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
