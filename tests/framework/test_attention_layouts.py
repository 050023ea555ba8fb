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
