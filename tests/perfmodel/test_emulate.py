"""Emulation (perfmodel/emulate): stand-ins, per-rank program vs the real step, slicing."""
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from framework import config as config_lib
from framework import config_file
from perfmodel.emulate import rank_program, slicing, standins
from perfmodel.emulate.topology import RankSpace


def _every_kind_body(x):
  a = jax.lax.psum(x, ("data", "tensor"))
  b = jax.lax.pmax(x, "tensor")
  c = jax.lax.all_gather(x, "data", axis=1, tiled=True)
  d = jax.lax.all_gather(x, "tensor", axis=0, tiled=False)
  e = jax.lax.psum_scatter(c, "data", scatter_dimension=1, tiled=True)
  f = jax.lax.all_to_all(x, "tensor", 0, 1, tiled=True)
  g = jax.lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])
  h = (jax.lax.axis_index("data") + 10 * jax.lax.axis_index("tensor"))[None]
  return a, b, c, d, e, f, g, h


def _every_kind_jaxpr():
  mesh = AbstractMesh((4, 2), ("data", "tensor"))
  fn = jax.shard_map(_every_kind_body, mesh=mesh, in_specs=P("data", "tensor"),
                     out_specs=(P(), P(), P(), P(), P(), P(), P(), P()), check_vma=False)
  outer = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((16, 8), jnp.float32))
  inner = outer.jaxpr.eqns[0].params["jaxpr"]
  from jax.extend import core as jcore
  return jcore.ClosedJaxpr(inner, ()), inner


def test_standins_keep_shapes_and_dtypes_of_every_collective_kind():
  closed, inner = _every_kind_jaxpr()
  space = RankSpace.of({"data": 4, "tensor": 2})
  rank = space.rank({"data": 2, "tensor": 1})
  fn, interp = standins.standin_program(closed, space, rank)
  out = jax.eval_shape(fn, jax.ShapeDtypeStruct((4, 4), jnp.float32))
  want = [v.aval for v in inner.outvars]
  assert [(o.shape, o.dtype) for o in out] == [(w.shape, w.dtype) for w in want]
  kinds = sorted({r.kind for r in interp.records})
  assert kinds == ["all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"]
  ag = [r for r in interp.records if r.primitive == "all_gather" and r.axes == ("data",)][0]
  assert ag.bytes == 4 * 16 * 4  # payload = the gathered result
  assert ag.group(space, rank) == space.group(rank, ("data",)) == (1, 3, 5, 7)
  perm = [r for r in interp.records if r.kind == "collective-permute"][0]
  assert perm.group(space, rank) == (rank, space.rank({"data": 3, "tensor": 1}))


def test_standins_equal_real_collectives_when_peers_hold_the_same_data():
  """With identical data on every device the stand-ins are the real collectives' exact results."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  closed, _ = _every_kind_jaxpr()
  space = RankSpace.of({"data": 4, "tensor": 2})
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x44 = jnp.arange(16, dtype=jnp.float32).reshape(4, 4) / 7
  x = jnp.tile(x44, (4, 2))  # every device's block is x44
  real = jax.jit(jax.shard_map(_every_kind_body, mesh=mesh, in_specs=P("data", "tensor"),
                               out_specs=(P("data"),) * 8, check_vma=False))(x)
  rank = space.rank({"data": 2, "tensor": 0})  # out_specs P('data') read the tensor=0 devices
  fn, _ = standins.standin_program(closed, space, rank)
  emu = jax.jit(fn)(x44)
  for i, (r, e) in enumerate(zip(real, emu)):
    rows = r.shape[0] // 4
    r_rank = np.asarray(r)[2 * rows:3 * rows]  # the block of device (data=2, tensor=*)
    np.testing.assert_allclose(r_rank.reshape(np.shape(e)), np.asarray(e), rtol=1e-6, err_msg=f"output {i}")


def _tiny(mesh, **kw):
  mesh = {**{a: 1 for a in config_lib.MESH_AXES}, **mesh}
  over = [f"--config.mesh.{k}={v}" for k, v in mesh.items()] + ["--config.mesh.form=shard_map"]
  over += [f"--config.{k}={v}" for k, v in kw.items()]
  cfg = config_file.load("experiments/configs/quickstart.py:runlocal=True", over)
  n = int(np.prod(list(mesh.values())))
  return config_lib.validate(cfg, n)


def test_emulated_dp_rank_reproduces_the_real_per_rank_computation():
  """2-rank data parallel: the emulated rank's loss and gradients equal the real shard_map step's
  (peers fed the same rows, so the reduced values are defined by local data)."""
  from parallelism import shard_map_step
  from parallelism.mesh import make_mesh
  cfg = _tiny({"data": 2})
  mesh = make_mesh(cfg.mesh, jax.devices()[:2])
  real = shard_map_step.build(cfg, mesh)
  state = real.init_state(jax.random.key(0))
  rows = jax.random.randint(jax.random.key(1), (cfg.data.global_batch // 2, cfg.data.seq_len + 1), 0, 256)
  rows = jnp.concatenate([rows, rows])  # both ranks see the same local batch
  inputs, targets = rows[:, :-1], rows[:, 1:]
  with real.context():
    loss_r, grads_r = jax.jit(real.loss_and_grads)(state.params, inputs, targets)
  prog = rank_program.build(cfg)
  fn, interp = standins.standin_program(prog.body, prog.space, rank=1)
  half = cfg.data.global_batch // 2
  params_local = jax.device_get(state.params)  # DP: every rank holds the whole (replicated) params
  outs = jax.jit(fn)(*jax.tree.leaves(params_local), inputs[half:], targets[half:])
  loss_e, grads_e = outs[0], jax.tree.unflatten(prog.params_treedef, outs[1:])
  np.testing.assert_allclose(float(loss_e), float(loss_r), rtol=1e-6)
  for (path, g_r), g_e in zip(jax.tree_util.tree_leaves_with_path(grads_r), jax.tree.leaves(grads_e)):
    np.testing.assert_allclose(np.asarray(g_e), np.asarray(g_r), rtol=2e-5, atol=1e-7, err_msg=str(path))
  assert {r.axes for r in interp.records} == {("data",)}


def test_slicing_picks_one_rank_per_distinct_program():
  flat = rank_program.build(_tiny({"data": 2, "tensor": 2}))
  s = slicing.slice_ranks(flat.body, flat.space)
  assert s.structural == () and len(s.classes) == 1 and s.classes[0].count == 4
  cfg = config_file.load("experiments/configs/llama3_70b.py:runlocal=True", ["--config.mesh.pipeline=4",
                                                                             "--config.mesh.microbatches=2"])
  cfg = config_lib.validate(cfg, 16)
  pp = rank_program.build(cfg)
  s = slicing.slice_ranks(pp.body, pp.space)
  assert s.structural == ("pipeline",)
  assert [c.label for c in s.classes] == ["pipeline:first", "pipeline:middle", "pipeline:last"]
  assert [pp.space.coords(c.representative)["pipeline"] for c in s.classes] == [0, 1, 3]
  assert sum(c.count for c in s.classes) == pp.space.n
  user = pp.space.rank({"pipeline": 2, "fsdp": 1, "tensor": 1})
  s2 = slicing.slice_ranks(pp.body, pp.space, [user])
  mid = [c for c in s2.classes if c.label == "pipeline:middle"][0]
  assert mid.representative == user and mid.chosen_by == "user"


def test_llama3_70b_at_8192_ranks_is_sliced_and_its_memory_computed_in_under_a_minute():
  """Compile only: per-rank program at real shapes (no 8192-device compile, which XLA:CPU refuses)."""
  import time
  from perfmodel.emulate import measure
  t0 = time.perf_counter()
  cfg = config_lib.validate(config_file.load("experiments/configs/llama3_70b.py"), 8192)
  prog = rank_program.build(cfg)
  s = slicing.slice_ranks(prog.body, prog.space)
  assert prog.space.n == 8192 and len(s.classes) == 3
  # Stages differ only by runtime branches of one SPMD program: one compile gives the static memory.
  compiled, interp, _ = measure.compile_rank(prog, s.classes[1].representative)
  mem = measure.memory_of(compiled)
  elapsed = time.perf_counter() - t0
  state_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(prog.local_state))
  assert mem["argument_size_in_bytes"] >= state_bytes
  assert state_bytes < mem["peak_bytes"] < 141e9  # fits an H200
  assert {r.kind for r in interp.records} >= {"all-gather", "reduce-scatter", "collective-permute", "all-reduce"}
  assert elapsed < 60, f"slicing + memory took {elapsed:.1f} s"


@pytest.mark.multiprocess
def test_shadow_peers_start_before_timing_and_are_gone_after(tmp_path):
  """--colocated 2: the rank is timed while a shadow of its peer runs on another core; no child outlives it."""
  import os
  from perfmodel.emulate import emulator, shadow
  if (os.cpu_count() or 1) < 2:
    pytest.skip("needs 2 cores: the shadow runs on the core the measuring process does not use")
  cfg = _tiny({"data": 2})
  sh = shadow.Shadows(cfg, rank=0, cores=shadow.colocated_cores(2), timeout_s=240)
  with sh:
    assert sh.ready_s is not None and all(p.poll() is None for p in sh.procs)
    pids = [p.pid for p in sh.procs]
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)
  res = emulator.emulate(cfg, repeats=2, warmup=1, colocated=2)
  assert res["colocated_ranks"] == 2 and res["interference"].startswith("1 shadow process")
  assert res["iteration_time_s"] > 0


def _cpu_s(pid: int) -> float:
  import os
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.multiprocess
def test_lockstep_shadow_idles_until_the_measured_rank_starts_a_step():
  import os
  import time
  from perfmodel.emulate import emulator, shadow
  if (os.cpu_count() or 1) < 2:
    pytest.skip("needs 2 cores: the shadow runs on the core the measuring process does not use")
  cfg = _tiny({"data": 2})
  with shadow.Shadows(cfg, rank=0, cores=shadow.colocated_cores(2), timeout_s=240, lockstep=True) as sh:
    pid = sh.procs[0].pid
    c0 = _cpu_s(pid)
    time.sleep(1.0)
    idle = _cpu_s(pid) - c0  # a back-to-back shadow burns ~1 s of CPU here
    assert idle < 0.3, f"lockstep shadow used {idle:.2f} s CPU while no step was started"
    c1 = _cpu_s(pid)
    deadline = time.time() + 60
    while _cpu_s(pid) - c1 < 0.2 and time.time() < deadline:
      for _ in range(20):
        sh.step()
      time.sleep(0.2)
    assert _cpu_s(pid) - c1 >= 0.2, "the shadow did not run the steps it was given"
  res = emulator.emulate(cfg, repeats=2, warmup=1, colocated=2, lockstep_shadows=True)
  assert "lockstep" in res["interference"] and res["iteration_time_s"] > 0


def test_a_rank_too_big_for_the_host_is_priced_not_run(monkeypatch, capsys):
  """The host reports less available memory than the rank's compiled peak: the rank is compiled, not run (no
  OOM kill), the emulation says so in one line and prices the step from the compiled program."""
  import collections
  import psutil
  from perfmodel.emulate import emulator
  Mem = collections.namedtuple("Mem", "available")
  monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem(available=1024))
  cfg = _tiny({"data": 2})
  res = emulator.emulate(cfg, repeats=1, warmup=0)
  assert res["executed"] is False and res["iteration_time_s"] > 0
  line = [n for n in res["notes"] if "not run" in n]
  assert line and "GiB available" in line[0]
  assert "not run" in capsys.readouterr().err
  assert all(r["measured_standin_program_s"] is None for r in res["ranks"])


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins") is None
                    or importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
                    reason="needs the CUDA plugin (pip install -e '.[tpu-aot]')")
def test_compile_only_emulation_on_a_gpu_target_prices_each_stage_as_predict(tmp_path, monkeypatch):
  """8 compile-only H100s, tensor 2 x data 2 x pipeline 2, 1F1B: every rank class is its pipeline stage's program
  from the target compile, priced by predict's chain; the slowest class is predict's step."""
  from perfmodel import predict
  from perfmodel.emulate import emulator
  monkeypatch.setenv("PRISMLLM_CACHE", str(tmp_path))
  cfg = config_lib.validate(config_file.load("experiments/configs/quickstart.py:runlocal=True", [
      "--config.mesh.data=2", "--config.mesh.tensor=2", "--config.mesh.pipeline=2", "--config.mesh.form=shard_map",
      "--config.mesh.microbatches=4", "--config.mesh.schedule=1f1b", "--config.model.dtype=bfloat16",
      "--config.data.global_batch=16"]), 8)
  res = emulator.emulate(cfg, hardware="h100", execute=False, out_dir=str(tmp_path / "emu"))
  p = predict.predict(cfg, "h100")
  assert res["real_devices"] == 0 and res["program"]["route"] == "target_compile"
  assert {r["class"]: r["stage"] for r in res["ranks"]} == {"pipeline:first": 0, "pipeline:last": 1}
  assert res["iteration_time_s"] == pytest.approx(p.step_time_s, rel=1e-9)
  assert res["peak_memory_bytes"] == p.peak_memory_bytes
  waits = {r["stage"]: r["wait_s"] for r in res["ranks"]}
  assert min(waits.values()) >= 0 and max(waits.values()) > 0  # the faster stage idles for the slower one
  assert all(os.path.exists(f) for f in res["trace_files"])
