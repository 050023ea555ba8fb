"""ZeRO-1 (``optim.shard_optimizer_state``, parallelism/zero.py): every layout of tests/parallelism/test_layouts.py,
in the forms it runs there, equals one device: loss and gradients at the start, then two full optimizer steps
(losses, gradient norms, updated parameters and optimizer state). With float32 master weights
(``optim.master_weights`` over bf16 parameters) the reference is one device with the same precision policy.

Tolerances: those of test_layouts.py / test_full_step.py (rtol 1e-5). The exception is the bf16 parameters of
the master-weights runs: they are the bf16 rounding of float32 masters that agree to 1e-5, and a master that
lies within 1e-5 of a bf16 rounding midpoint rounds to the neighbouring value on one side, one bf16 unit
(at most 2^-7 of the value) away. Rounding adds at most that one unit to the masters' difference, so the
params are compared with the masters' tolerance plus one bf16 unit (rtol 1e-5 + 2^-7, atol 1e-5).

The compiled step's per-device optimizer state shrinks by the data size (memory_analysis of the compiled
step), and a checkpoint written by one layout restores into the other.
"""
import collections
import importlib.util
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _pytest.mark.structures import ParameterSet

from framework import checkpoint as ck
from framework import optim
from framework.config import CheckpointConfig
from tests.parallelism import harness
from tests.parallelism.test_layouts import JIT_PIPELINE, NON_PIPELINE, NON_PIPELINE_SHARD_MAP_EXTRA, PIPELINE

TOL = {"rtol": 1e-5, "atol": 1e-6}  # loss and gradients (test_layouts.py)
STATE_TOL = {"rtol": 1e-5, "atol": 1e-5}  # after two AdamW steps (test_full_step.py)
BF16_UNIT = 2.0 ** -7  # bf16 has 8 significand bits: one unit in the last place is at most 2^-7 of the value
ZERO = {"shard_optimizer_state": True}
MASTER = ({"param_dtype": "bfloat16"}, {"master_weights": True})


def _cases():
  """(mesh, form) of every layout the equivalence tests cover, keeping their slow marks."""
  out = []
  for items, forms, with_schedule in ((NON_PIPELINE, ("jit", "shard_map"), False),
                                      (NON_PIPELINE_SHARD_MAP_EXTRA, ("shard_map",), False),
                                      (PIPELINE, ("shard_map",), True), (JIT_PIPELINE, ("jit",), True)):
    for item in items:
      values, marks = (item.values, item.marks) if isinstance(item, ParameterSet) else (
          item if with_schedule else (item,), ())
      mesh = dict(values[0], schedule=values[1]) if with_schedule else values[0]
      for form in forms:
        out.append((mesh, form, marks))
  # a layout listed twice (slow in one list, default in another) runs once, unmarked if either is
  kept = {}
  for mesh, form, marks in out:
    key = _id(mesh, form)
    if key not in kept or not marks:
      kept[key] = (mesh, form, marks)
  return list(kept.values())


def _id(mesh, form):
  return form + "-" + "x".join(f"{k}{v}" for k, v in mesh.items())


# Default run: every data-parallel axis and the tensor axis in each form, ZeRO-3 under ZeRO-1, both pipeline
# forms; the other layouts of the list (the same code paths in more combinations) are marked slow.
DEFAULT = {"jit-data2xtensor4", "shard_map-data2xtensor4", "jit-data4xsequence2", "shard_map-fsdp4xtensor2",
           "shard_map-fsdp8xruleszero3", "shard_map-pipeline2xtensor4xmicrobatches2xschedule1f1b",
           "jit-pipeline2xdata4xmicrobatches2xschedule1f1b"}
CASES = [pytest.param(m, f, marks=() if _id(m, f) in DEFAULT else pytest.mark.slow, id=_id(m, f))
         for m, f, _ in _cases()]
# Master weights: the default run covers the gradient dtype and the explicit update in each form and the
# pipeline's reduction; the rest of the layouts are marked slow.
MASTER_DEFAULT = {"jit-data4xsequence2", "shard_map-fsdp2xsequence2xtensor2",
                  "shard_map-pipeline2xtensor4xmicrobatches2xschedule1f1b"}
MASTER_CASES = [pytest.param(m, f, marks=() if _id(m, f) in MASTER_DEFAULT else pytest.mark.slow, id=_id(m, f))
                for m, f, _ in _cases()]


def _two_steps(st, state_np, batches):
  state = jax.device_put(state_np, st.state_shardings)
  losses, norms = [], []
  for b in batches:
    state, metrics = st(state, st.put_batch(b))
    losses.append(float(metrics.loss))
    norms.append(float(metrics.grad_norm))
  return jax.tree.map(np.asarray, state), losses, norms


def _grad_state(state):
  """The state whose params the step differentiates (bf16 params in the compute dtype, float32, here)."""
  return state.replace(params=optim.grad_params(state.params, state.opt_state, jnp.float32))


@pytest.fixture(scope="module")
def references():
  """One-device runs per precision policy: initial state, loss, gradients and two optimizer steps."""
  out = {}
  for master in (False, True):
    model, opt = MASTER if master else ({}, {})
    st = harness.build({}, "jit", model, optim=opt)
    state = jax.tree.map(np.asarray, st.init_state(jax.random.key(0)))
    batches = [harness.make_batch(st.cfg, seed=s) for s in (0, 1)]
    loss, grads = harness.loss_and_grads(st, _grad_state(state), batches[0])
    after, losses, norms = _two_steps(st, state, batches)
    out[master] = dict(state=state, batches=batches, loss=loss, grads=grads, after=after, losses=losses, norms=norms)
  return out


def _check(ref, mesh, form, master):
  model, opt = MASTER if master else ({}, {})
  st = harness.build(mesh, form, model, optim=dict(opt, **ZERO))
  loss, grads = harness.loss_and_grads(st, _grad_state(ref["state"]), ref["batches"][0])
  assert abs(loss - ref["loss"]) <= TOL["atol"] + TOL["rtol"] * abs(ref["loss"])
  harness.assert_trees_close(grads, ref["grads"], **TOL)

  after, losses, norms = _two_steps(st, ref["state"], ref["batches"])
  np.testing.assert_allclose(losses, ref["losses"], **TOL)
  np.testing.assert_allclose(norms, ref["norms"], rtol=1e-5)
  assert int(after.step) == 2
  harness.assert_trees_close(after.opt_state, ref["after"].opt_state, **STATE_TOL)
  if master:
    assert isinstance(after.opt_state, optim.MasterState)
    assert {x.dtype for x in jax.tree.leaves(after.params)} == {jnp.dtype(jnp.bfloat16)}
    f32 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float32), t)  # noqa: E731
    harness.assert_trees_close(f32(after.params), f32(ref["after"].params), rtol=STATE_TOL["rtol"] + BF16_UNIT,
                               atol=STATE_TOL["atol"])
    # the params are the cast of this run's own masters
    for p, m in zip(jax.tree.leaves(after.params), jax.tree.leaves(after.opt_state.master)):
      np.testing.assert_array_equal(np.asarray(p), np.asarray(m).astype(jnp.bfloat16))
  else:
    harness.assert_trees_close(after.params, ref["after"].params, **STATE_TOL)
  # the update really moved the parameters (a no-op step would pass the checks above trivially)
  moved = [float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
           for a, b in zip(jax.tree.leaves(after.params), jax.tree.leaves(ref["state"].params))]
  assert max(moved) > 1e-3
  # and the optimizer state is sharded over the data-parallel axes wherever the layout has one
  sizes = dict(st.mesh.shape)
  dp = [a for a in ("data", "fsdp", "sequence") if sizes[a] > 1]
  if dp:
    moments = [sh for sh in jax.tree.leaves(st.state_shardings.opt_state) if len(sh.spec)]
    assert all(set(dp) <= set(_spec_axes(sh.spec)) for sh in moments)


def _spec_axes(spec):
  return [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]


@pytest.mark.parametrize("mesh,form", CASES)
def test_zero1_matches_single_device(references, mesh, form):
  _check(references[False], mesh, form, master=False)


@pytest.mark.parametrize("mesh,form", MASTER_CASES)
def test_zero1_master_weights_match_single_device(references, mesh, form):
  _check(references[True], mesh, form, master=True)


# ------------------------------------------------------------------------ a data size that divides no dim


@pytest.mark.parametrize("mesh,form,master", [
    ({"data": 3}, "jit", False), ({"data": 3}, "shard_map", True),
    pytest.param({"pipeline": 2, "data": 3, "microbatches": 2, "schedule": "1f1b"}, "shard_map", False,
                 marks=pytest.mark.slow)], ids=["jit-data3", "shard_map-data3-master", "shard_map-pipeline2xdata3"])
def test_zero1_pads_where_the_data_size_divides_no_dim(mesh, form, master):
  """data=3 over the tiny model's power-of-two widths (as 48 data-parallel ranks over Megatron's): the
  optimizer state of every matrix is still split over 'data', on a dim padded with zeros to a multiple of 3,
  and two steps equal one device's (losses, norms, params, the state cropped to the params' shapes). The
  per-device state is a third of the padded size (the compiled step's argument bytes)."""
  model, opt = MASTER if master else ({}, {})
  data = {"global_batch": 6}
  ref = harness.build({}, "jit", model, data=data, optim=opt)
  state = jax.tree.map(np.asarray, ref.init_state(jax.random.key(0)))
  batches = [harness.make_batch(ref.cfg, seed=s) for s in (0, 1)]
  want, want_losses, want_norms = _two_steps(ref, state, batches)

  st = harness.build(mesh, form, model, data=data, optim=dict(opt, **ZERO))
  shapes = st.abstract_state()
  assert jax.tree.map(lambda x: x.shape, jax.tree.map(np.asarray, st.init_state(jax.random.key(0)))) == \
      jax.tree.map(lambda x: x.shape, shapes)
  # the reference's state, its optimizer state zero-padded (the same start: XLA may fold a float32 master's
  # initial bf16 rounding away in one program and not in the other)
  start = state.replace(opt_state=jax.tree.map(lambda x, s: np.asarray(optim.pad(x, s.shape)), state.opt_state,
                                               shapes.opt_state))
  got, losses, norms = _two_steps(st, start, batches)
  np.testing.assert_allclose(losses, want_losses, **TOL)
  np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
  f32 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float32), t)  # noqa: E731
  harness.assert_trees_close(f32(got.params), f32(want.params), rtol=STATE_TOL["rtol"] + (BF16_UNIT if master else 0),
                             atol=STATE_TOL["atol"])
  padded = [x for x in jax.tree.leaves(got.opt_state) if x.ndim]
  wanted = [x for x in jax.tree.leaves(want.opt_state) if x.ndim]
  assert any(a.shape != b.shape for a, b in zip(padded, wanted))  # the layout really pads
  for a, b in zip(padded, wanted):
    np.testing.assert_allclose(optim.crop(a, b.shape), b, **STATE_TOL)
    assert not np.any(np.where(np.asarray(optim.pad(np.ones(b.shape, bool), a.shape)), 0, a))  # padding stays 0
  sizes = dict(st.mesh.shape)
  states = [sh for sh in jax.tree.leaves(st.state_shardings.opt_state) if len(sh.spec)]
  assert all("data" in _spec_axes(sh.spec) for sh in states)
  arg = st.lower().compile().memory_analysis().argument_size_in_bytes
  per_device = sum(x.size * x.dtype.itemsize // sizes["data"] // (sizes["pipeline"] if "pipeline" in
                   _spec_axes(sh.spec) else 1) for x, sh in zip(padded, states))
  params = sum(x.size * x.dtype.itemsize // (sizes["pipeline"] if "pipeline" in _spec_axes(sh.spec) else 1)
               for x, sh in zip(jax.tree.leaves(got.params), jax.tree.leaves(st.state_shardings.params)))
  assert per_device + params <= arg <= per_device + params + 1024


# ------------------------------------------------------------------------------------------------ memory


def _compiled(mesh, form, model=None, opt=None):
  st = harness.build(mesh, form, model, optim=opt)
  return st, st.lower().compile()


@pytest.mark.parametrize("form", ["jit", "shard_map"])
def test_optimizer_state_bytes_shrink_by_the_data_size(form):
  """data=8: the compiled step's inputs hold params + 1/8 of Adam's two moments (every leaf of the tiny model
  has a dim divisible by 8), exactly the hand count; bf16 params with float32 masters: 2 + 12/8 bytes a param."""
  mesh = {"data": 8}
  st, plain = _compiled(mesh, form)
  n = st.cfg.model.n_params()
  fixed = plain.memory_analysis().argument_size_in_bytes - 3 * 4 * n  # step, Adam's count, the batch shard
  assert 0 < fixed < 1024
  _, zero1 = _compiled(mesh, form, opt=ZERO)
  assert zero1.memory_analysis().argument_size_in_bytes == fixed + 4 * n + 2 * 4 * n // 8
  _, master = _compiled(mesh, form, MASTER[0], dict(MASTER[1], **ZERO))
  assert master.memory_analysis().argument_size_in_bytes == fixed + 2 * n + 3 * 4 * n // 8
  # the state is updated in place (donated) in every variant
  for c in (plain, zero1, master):
    assert c.memory_analysis().alias_size_in_bytes >= c.memory_analysis().argument_size_in_bytes - 1024
  hlo = collections.Counter(re.findall(r" (all-reduce|reduce-scatter|all-gather)(?:-start)?\(", zero1.as_text()))
  assert hlo["all-gather"] > 0  # the updated parameters come back to every device
  if form == "shard_map":
    assert hlo["reduce-scatter"] > 0  # the gradients' psum_scatter, as written


HAS_CUDA = importlib.util.find_spec("jax_plugins") is not None and \
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


@pytest.mark.skipif(not HAS_CUDA, reason='the tpu-aot extra is not installed (pip install -e ".[tpu-aot]")')
def test_jit_form_reduce_scatters_on_h100():
  """GSPMD's ZeRO-1 program for 8 H100s (compile-only): gradients reduce-scattered, parameters all-gathered,
  and no full-gradient all-reduce left (the one all-reduce is the loss / norm's scalars)."""
  from parallelism import step as step_lib
  from parallelism import targets
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    cfg = harness.make_cfg({"data": 8}, "jit", optim=ZERO)
    compiled = step_lib.build_step(cfg, targets.target_mesh(cfg.mesh, "h100")).lower().compile()
  finally:
    jax.config.update("jax_disable_most_optimizations", old)
  hlo = compiled.as_text()
  assert re.search(r" reduce-scatter(-start)?\(", hlo) and re.search(r" all-gather(-start)?\(", hlo)
  reduced = [sum(math.prod(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", out))
             for out in re.findall(r"= (.*?) all-reduce(?:-start)?\(", hlo)]
  assert reduced and all(r <= 8 for r in reduced), reduced
  n = cfg.model.n_params()
  arg = targets.compiled_memory(compiled)["argument"]
  assert 4 * n + 8 * n // 8 <= arg <= 4 * n + 8 * n // 8 + 1024


# ------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("save_zero1", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["plain-to-zero1", "zero1-to-plain"])
def test_checkpoint_restores_across_zero1(reference, tmp_path, save_zero1):
  """A state saved by one layout restores into the other's shardings with the same values, and the next
  step from it equals the next step of the layout that saved it."""
  mesh = {"data": 4, "tensor": 2}
  a = harness.build(mesh, "shard_map", optim=ZERO if save_zero1 else None)
  b = harness.build(mesh, "jit", optim=None if save_zero1 else ZERO)
  batches = [harness.make_batch(a.cfg, seed=s) for s in (0, 1)]
  state = jax.device_put(reference["state"], a.state_shardings)
  state, _ = a(state, a.put_batch(batches[0]))
  c = ck.Checkpointer(str(tmp_path), CheckpointConfig(keep=1, async_save=False))
  c.save(1, state, {"step": 1})
  c.wait()
  restored, data = c.restore(b.abstract_state())
  c.close()
  assert data["step"] == 1
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(b.state_shardings)):
    assert got.sharding.is_equivalent_to(want, got.ndim)
  next_a, _ = a(state, a.put_batch(batches[1]))
  next_b, _ = b(restored, b.put_batch(batches[1]))
  harness.assert_trees_close(jax.tree.map(np.asarray, next_b), jax.tree.map(np.asarray, next_a), **STATE_TOL)


# ------------------------------------------------------------------------------ a published-scale example

LLAMA2_7B = [
    "--config.model.vocab_size=32000", "--config.model.d_model=4096", "--config.model.n_heads=32",
    "--config.model.n_kv_heads=32", "--config.model.d_ff=11008", "--config.model.n_layers=32",
    "--config.model.max_seq_len=4096", "--config.model.dtype=bfloat16", "--config.model.remat=full",
    "--config.data.seq_len=4096", "--config.data.global_batch=8", "--config.mesh.data=8", "--config.mesh.fsdp=1",
    "--config.mesh.tensor=1"]
BF16_MASTER = ["--config.model.param_dtype=bfloat16", "--config.optim.master_weights=True"]
ZERO1 = ["--config.optim.shard_optimizer_state=True"]
VARIANTS = {"f32 params": [], "f32 params, ZeRO-1": ZERO1, "bf16 params + f32 masters": BF16_MASTER,
            "bf16 params + f32 masters, ZeRO-1": BF16_MASTER + ZERO1}
HAS_TPU = importlib.util.find_spec("libtpu") is not None
HBM_GIB = {"h100": 80 * 10**9 / 2**30, "tpu_v5p": 95.74}  # H100 SXM datasheet (80 GB); what libtpu reports for v5p


@pytest.mark.slow
@pytest.mark.parametrize("hardware,form", [
    pytest.param("h100", "jit", marks=pytest.mark.skipif(not HAS_CUDA, reason="tpu-aot extra")),
    pytest.param("h100", "shard_map", marks=pytest.mark.skipif(not HAS_CUDA, reason="tpu-aot extra")),
    pytest.param("tpu_v5p", "jit", marks=pytest.mark.skipif(not HAS_TPU, reason="tpu-aot extra"))])
def test_llama2_7b_on_8_chips_fits_only_with_zero1(hardware, form):
  """Llama-2-7B, pure data parallelism on 8 chips, compiled for the target: per-chip memory of each variant
  (printed; run with -s). Replicated AdamW state does not fit the chip; ZeRO-1 with bf16 params does."""
  from framework import config as config_lib
  from framework import config_file
  from parallelism import step as step_lib
  from parallelism import targets
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  rows = {}
  try:
    for name, overrides in VARIANTS.items():
      cfg = config_file.load("experiments/configs/quickstart.py",
                             LLAMA2_7B + overrides + [f"--config.mesh.form={form}"])
      mesh = targets.target_mesh(cfg.mesh, hardware)
      cfg = config_lib.validate(cfg, mesh.size)
      try:
        mem = targets.compiled_memory(step_lib.build_step(cfg, mesh).lower().compile())
        rows[name] = (mem["argument"] / 2**30, mem["needed"] / 2**30)
      except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program that does not fit
        assert "RESOURCE_EXHAUSTED" in str(e)
        rows[name] = (None, float(re.search(r"\(([\d.]+)G\) exceeds", str(e)).group(1)))
  finally:
    jax.config.update("jax_disable_most_optimizations", old)
  for name, (arg, needed) in rows.items():
    print(f"{hardware} {form} Llama-2-7B x8 data-parallel, {name}: arguments "
          f"{'-' if arg is None else f'{arg:.1f}'} GiB, needed {needed:.1f} GiB (HBM {HBM_GIB[hardware]:.1f} GiB)")
  assert rows["f32 params"][1] > HBM_GIB[hardware]
  assert rows["bf16 params + f32 masters"][1] > HBM_GIB[hardware]
  assert rows["bf16 params + f32 masters, ZeRO-1"][1] < HBM_GIB[hardware]
  assert rows["f32 params, ZeRO-1"][1] < rows["f32 params"][1] / 1.5
