"""Every attention kind in the parallel step's two forms (jit: GSPMD; shard_map: explicit collectives, incl.
sequence parallelism and the pipeline) gives the single-device dense loss and gradients.

Built with the layout harness of tests/parallelism (the same step builders training uses). Sequence
parallelism in the shard_map form hands each device a slice of the queries and the all-gathered keys, so
it exercises the kernels' position-based masks; the jit form runs the same model under GSPMD.
Float32; tolerances as tests/parallelism/test_layouts.py, loosened 10x for the kernels' own summation order.
"""
import jax
import numpy as np
import pytest

from framework import attention
from framework.config import ConfigError
from tests.parallelism import harness

LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-5}
BLOCK = {"attention_block": 4}  # seq 16: four key blocks

LAYOUTS = [  # (mesh, form)
    ({"data": 2, "tensor": 4}, "jit"),
    ({"data": 2, "tensor": 4}, "shard_map"),
    ({"data": 4, "sequence": 2}, "jit"),
    ({"fsdp": 2, "sequence": 2, "tensor": 2}, "shard_map"),
    ({"pipeline": 2, "tensor": 4, "microbatches": 2, "schedule": "1f1b"}, "shard_map"),
    ({"pipeline": 2, "data": 4, "microbatches": 2, "schedule": "1f1b"}, "jit"),
]


@pytest.fixture(scope="module", autouse=True)
def _fast_compiles():
  """As in tests/parallelism: XLA's optimisation passes cost time and are irrelevant to equivalence."""
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", old)


_REFERENCE = {}


def _reference(model=None, data=None):
  key = (tuple(sorted((model or {}).items())), tuple(sorted((data or {}).items())))
  if key not in _REFERENCE:
    st = harness.build({}, "jit", model, data)
    state = jax.tree.map(np.asarray, st.init_state(jax.random.key(0)))
    batch = harness.make_batch(st.cfg)
    loss, grads = harness.loss_and_grads(st, state, batch)
    _REFERENCE[key] = (state, batch, loss, grads)
  return _REFERENCE[key]


def _check(mesh, form, model, data=None):
  # the reference: the same model with dense attention and no remat (neither changes the function)
  same_function = {k: v for k, v in model.items() if k not in ("attention", "attention_block", "remat")}
  state, batch, want_loss, want_grads = _reference(same_function, data)
  st = harness.build(mesh, form, model, data)
  loss, grads = harness.loss_and_grads(st, state, batch)
  assert abs(loss - want_loss) <= LOSS_TOL["atol"] + LOSS_TOL["rtol"] * abs(want_loss)
  harness.assert_trees_close(grads, want_grads, **GRAD_TOL)


def _id(layout):
  mesh, form = layout
  return form + "-" + "x".join(f"{k}{v}" for k, v in mesh.items() if k not in ("schedule", "microbatches"))


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
@pytest.mark.parametrize("kind", ["blockwise", "dot_product"])
def test_kind_matches_single_device_dense(kind, layout):
  mesh, form = layout
  _check(mesh, form, {"attention": kind, **BLOCK})


def test_blockwise_with_named_remat_in_the_shard_map_form():
  _check({"fsdp": 2, "sequence": 2, "tensor": 2}, "shard_map",
         {"attention": "blockwise", "remat": "save_qkv_proj", **BLOCK})


SPLASH = {"attention": "splash", "attention_block": 128, "max_seq_len": 256}


def test_splash_in_the_jit_form(monkeypatch):
  """Splash runs in a shard_map over the batch and head axes inside the GSPMD program (Pallas interpreter
  here; the Mosaic kernel on TPU)."""
  monkeypatch.setattr(attention, "SPLASH_INTERPRET", True)
  _check({"data": 2, "tensor": 4}, "jit", SPLASH, data={"seq_len": 256})


@pytest.mark.parametrize("mesh, form", [({"data": 2, "tensor": 4}, "shard_map"),
                                        ({"pipeline": 2, "data": 4, "microbatches": 2}, "jit"),
                                        ({"data": 4, "sequence": 2}, "jit")])
def test_splash_outside_its_layouts_is_a_config_error(mesh, form):
  with pytest.raises(ConfigError, match=r"model.attention='splash' .*(blockwise|mesh.sequence=1)"):
    harness.make_cfg(mesh, form, SPLASH, {"seq_len": 256})


# Ring attention (context parallelism): K/V blocks go around the 'sequence' ring over zig-zag chunks. seq 16 over
# sequence=C gives chunks of 16/(2C) tokens; attention_block 2 makes the blockwise inner loop run several blocks.
RING_LAYOUTS = [
    ({"data": 2, "sequence": 4}, "shard_map"),
    ({"fsdp": 2, "sequence": 2, "tensor": 2}, "shard_map"),
    pytest.param({"sequence": 8}, "shard_map", marks=pytest.mark.slow),
    pytest.param({"data": 4, "sequence": 2}, "jit", marks=pytest.mark.slow),  # GSPMD: the blockwise kernel
]


@pytest.mark.parametrize("mesh, form", RING_LAYOUTS, ids=lambda v: v if isinstance(v, str) else "x".join(
    f"{k}{x}" for k, x in v.items()))
def test_ring_matches_single_device_dense(mesh, form):
  _check(mesh, form, {"attention": "ring", "attention_block": 2})


def test_gpu_ring_schedule_and_merge_match_single_device_dense(monkeypatch):
  """The GPU ring (framework/ring_cudnn.py: per-block (output, log-sum-exp) merged, block backward from the final
  output and log-sum-exp) with XLA block kernels in place of cuDNN's, which have no CPU implementation."""
  from framework import ring_cudnn  # noqa: PLC0415
  monkeypatch.setattr(attention, "RING_BLOCKS", ring_cudnn.xla_blocks())
  _check({"data": 2, "sequence": 4}, "shard_map", {"attention": "ring", "attention_block": 2})


def test_ring_passes_kv_around_instead_of_gathering_it():
  # data x sequence, no FSDP: the only all-gathers left are the token ids' (zig-zag layout, int32); K/V travel by
  # collective permutes (forward ring, backward ring and the gradients' last hop).
  st = harness.build({"data": 2, "sequence": 4}, "shard_map", {"attention": "ring", "attention_block": 2})
  state, batch = st.abstract_state(), st.abstract_batch()
  with st.context():
    jaxpr = jax.make_jaxpr(st.loss_and_grads)(state.params, batch["inputs"], batch["targets"])
  seen = {"all_gather": [], "ppermute": 0}

  def walk(jx):
    for e in jx.eqns:
      if e.primitive.name == "all_gather":
        seen["all_gather"].append(str(e.invars[0].aval.dtype))
      seen["ppermute"] += e.primitive.name == "ppermute"
      for p in e.params.values():
        for j in (p if isinstance(p, (tuple, list)) else (p,)):
          if hasattr(j, "eqns"):
            walk(j)
          elif hasattr(getattr(j, "jaxpr", None), "eqns"):
            walk(j.jaxpr)
  walk(jaxpr.jaxpr)
  assert seen["all_gather"] == ["int32", "int32"], seen
  assert seen["ppermute"] >= 3


@pytest.mark.parametrize("mesh, data, match", [
    ({"sequence": 4}, {"seq_len": 12}, "multiple of 8"),
    ({"pipeline": 2, "sequence": 2, "microbatches": 2}, None, "pipeline"),
])
def test_ring_outside_its_layouts_is_a_config_error(mesh, data, match):
  with pytest.raises(ConfigError, match=match):
    harness.make_cfg(mesh, "shard_map", {"attention": "ring", "attention_block": 4, "max_seq_len": 16}, data)
