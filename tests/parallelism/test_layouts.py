"""Every layout, in both forms, gives the single-device loss and gradients (float32, tight)."""
import jax
import numpy as np
import pytest

from tests.parallelism import harness

LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}

S = pytest.mark.slow
# Default-run set: each axis at least once in each form, the 2-D/3-D mixes, both schedules; the rest
# (same code paths, more combinations) is marked slow to keep the default suite within its budget.
NON_PIPELINE = [
    pytest.param({"data": 8}, marks=S),
    pytest.param({"fsdp": 8}, marks=S),
    pytest.param({"tensor": 4}, marks=S),
    pytest.param({"sequence": 8}, marks=S),
    {"data": 2, "tensor": 4},
    {"fsdp": 4, "tensor": 2},
    {"data": 4, "sequence": 2},
    pytest.param({"data": 2, "fsdp": 2, "tensor": 2}, marks=S),
    pytest.param({"fsdp": 2, "sequence": 2, "tensor": 2}, marks=S),
    pytest.param({"data": 4, "fsdp": 2, "rules": "zero3"}, marks=S),
    # FSDP over the fsdp and context-parallel ranks together (torchtitan's dp_shard_cp)
    {"fsdp": 2, "sequence": 2, "tensor": 2, "rules": "fsdp_sequence"},
]
# Partitioner form only: MaxText's rules shard the residual stream's embed dim over the tensor axis.
NON_PIPELINE_JIT_EXTRA = [
    {"fsdp": 2, "tensor": 4, "rules": "maxtext"},
]
# Explicit-collective form only, on top of the list above.
NON_PIPELINE_SHARD_MAP_EXTRA = [
    {"fsdp": 2, "sequence": 2, "tensor": 2},
    # zero3 shards over ('data', 'fsdp') with data=1: a gather over the size-1 axis must not make the loss
    # "varying over data" (shard_map would refuse the step)
    {"fsdp": 8, "rules": "zero3"},
    pytest.param({"data": 8}, marks=S),
    pytest.param({"data": 4, "fsdp": 2, "rules": "zero3"}, marks=S),
]
PIPELINE = [  # (mesh, schedule)
    ({"pipeline": 2, "tensor": 4, "microbatches": 2}, "1f1b"),
    ({"pipeline": 4, "tensor": 2, "microbatches": 4}, "gpipe"),
    pytest.param({"pipeline": 2, "microbatches": 4}, "gpipe", marks=S),
    pytest.param({"pipeline": 2, "microbatches": 4}, "1f1b", marks=S),
    pytest.param({"pipeline": 2, "data": 4, "microbatches": 2}, "gpipe", marks=S),
    pytest.param({"pipeline": 2, "data": 4, "microbatches": 2}, "1f1b", marks=S),
    pytest.param({"pipeline": 2, "tensor": 4, "microbatches": 2}, "gpipe", marks=S),
    pytest.param({"pipeline": 4, "tensor": 2, "microbatches": 4}, "1f1b", marks=S),
    pytest.param({"pipeline": 2, "data": 2, "tensor": 2, "microbatches": 2}, "gpipe", marks=S),
    pytest.param({"pipeline": 2, "data": 2, "tensor": 2, "microbatches": 2}, "1f1b", marks=S),
    pytest.param({"pipeline": 2, "fsdp": 2, "sequence": 2, "microbatches": 2}, "gpipe", marks=S),
    pytest.param({"pipeline": 2, "fsdp": 2, "sequence": 2, "microbatches": 2}, "1f1b", marks=S),
    ({"pipeline": 2, "fsdp": 2, "sequence": 2, "microbatches": 2, "rules": "fsdp_sequence"}, "1f1b"),
]
# Virtual stages (mesh.virtual_stages = v, layer stack stored as v x L/v): 1f1b = Megatron's interleaved 1F1B,
# gpipe = MaxText's circular pipeline. (mesh, schedule, model overrides); 8 layers where P x v = 8.
VIRTUAL = [
    ({"pipeline": 2, "data": 2, "tensor": 2, "microbatches": 2, "virtual_stages": 2}, "1f1b", None),
    ({"pipeline": 2, "fsdp": 2, "sequence": 2, "microbatches": 4, "virtual_stages": 2}, "gpipe", None),
    pytest.param({"pipeline": 4, "tensor": 2, "microbatches": 4, "virtual_stages": 2}, "1f1b", {"n_layers": 8},
                 marks=S),
    pytest.param({"pipeline": 4, "data": 2, "microbatches": 4, "virtual_stages": 2}, "gpipe", {"n_layers": 8},
                 marks=S),
    pytest.param({"pipeline": 2, "microbatches": 2, "virtual_stages": 4}, "1f1b", {"n_layers": 8}, marks=S),
]
JIT_VIRTUAL = [
    ({"pipeline": 2, "data": 4, "microbatches": 2, "virtual_stages": 2}, "1f1b", None),
    pytest.param({"pipeline": 2, "tensor": 4, "microbatches": 4, "virtual_stages": 2}, "gpipe", None, marks=S),
]
# Recompute is model.remat's business: the stashing engine keeps what the policy saves.
REMAT = [
    ({"pipeline": 2, "tensor": 2, "data": 2, "microbatches": 2}, "1f1b", {"remat": "full"}),
    pytest.param({"pipeline": 2, "fsdp": 4, "microbatches": 2, "virtual_stages": 2}, "gpipe",
                 {"remat": "minimal", "attention": "blockwise", "attention_block": 8}, marks=S),
    # residuals offloaded to pinned host memory are stashed there
    pytest.param({"pipeline": 2, "tensor": 2, "microbatches": 2}, "1f1b", {"remat": "qkv_proj_offloaded"}, marks=S),
]
# The jit form runs the pipeline as a shard_map manual over 'pipeline' only, which XLA supports
# with at most one other axis of size > 1 (see parallelism/shard_map_step.check).
JIT_PIPELINE = [
    ({"pipeline": 2, "data": 4, "microbatches": 2}, "1f1b"),
    pytest.param({"pipeline": 2, "data": 4, "microbatches": 2}, "gpipe", marks=S),
    pytest.param({"pipeline": 2, "tensor": 4, "microbatches": 2}, "gpipe", marks=S),
    pytest.param({"pipeline": 2, "tensor": 4, "microbatches": 2}, "1f1b", marks=S),
    pytest.param({"pipeline": 4, "tensor": 2, "microbatches": 4}, "gpipe", marks=S),
    pytest.param({"pipeline": 2, "microbatches": 4}, "1f1b", marks=S),
]


def _id(mesh):
  return "x".join(f"{k}{v}" for k, v in mesh.items())


def _check(reference, mesh, form, model=None):
  st = harness.build(mesh, form, model)
  v = mesh.get("virtual_stages", 1)
  loss, grads = harness.loss_and_grads(st, harness.chunk_layers(reference["state"], v), reference["batch"])
  assert abs(loss - reference["loss"]) <= LOSS_TOL["atol"] + LOSS_TOL["rtol"] * abs(reference["loss"])
  harness.assert_trees_close(harness.unchunk_layers(grads, v), reference["grads"], **GRAD_TOL)


def _own_reference(model):
  """The single-device reference of another model (its own init and batch)."""
  st = harness.build({}, "jit", model)
  state = jax.tree.map(np.asarray, st.init_state(jax.random.key(0)))
  batch = harness.make_batch(st.cfg)
  loss, grads = harness.loss_and_grads(st, state, batch)
  return {"state": state, "batch": batch, "loss": loss, "grads": grads}


@pytest.mark.parametrize("mesh", NON_PIPELINE, ids=_id)
@pytest.mark.parametrize("form", ["jit", "shard_map"])
def test_layout_matches_single_device(reference, mesh, form):
  _check(reference, mesh, form)


@pytest.mark.parametrize("mesh", NON_PIPELINE_SHARD_MAP_EXTRA, ids=_id)
def test_shard_map_extra_layouts_match_single_device(reference, mesh):
  _check(reference, mesh, "shard_map")


@pytest.mark.parametrize("mesh", NON_PIPELINE_JIT_EXTRA, ids=_id)
def test_jit_extra_layouts_match_single_device(reference, mesh):
  _check(reference, mesh, "jit")


def test_maxtext_rules_shard_the_residual_stream():
  """The 'maxtext' preset's residual stream is sharded over the tensor axis in the compiled step: its per-device
  temporaries are smaller than the default preset's on the same mesh."""
  sizes = {}
  for rules in ("default", "maxtext"):
    st = harness.build({"fsdp": 2, "tensor": 4, "rules": rules}, "jit", model={"max_seq_len": 64},
                       data={"global_batch": 8, "seq_len": 64})
    sizes[rules] = st.lower().compile().memory_analysis().temp_size_in_bytes
  assert sizes["maxtext"] < sizes["default"], sizes


@pytest.mark.parametrize("mesh,schedule", PIPELINE, ids=lambda v: _id(v) if isinstance(v, dict) else v)
def test_pipeline_shard_map_matches_single_device(reference, mesh, schedule):
  _check(reference, dict(mesh, schedule=schedule), "shard_map")


@pytest.mark.parametrize("mesh,schedule", JIT_PIPELINE, ids=lambda v: _id(v) if isinstance(v, dict) else v)
def test_pipeline_jit_matches_single_device(reference, mesh, schedule):
  _check(reference, dict(mesh, schedule=schedule), "jit")


def _pipe_id(v):
  if isinstance(v, dict):
    return _id(v)
  return v if isinstance(v, str) else "model-default"


@pytest.mark.parametrize("mesh,schedule,model", VIRTUAL, ids=_pipe_id)
def test_virtual_stages_shard_map_match_single_device(reference, mesh, schedule, model):
  _check(_own_reference(model) if model else reference, dict(mesh, schedule=schedule), "shard_map", model)


@pytest.mark.parametrize("mesh,schedule,model", JIT_VIRTUAL, ids=_pipe_id)
def test_virtual_stages_jit_match_single_device(reference, mesh, schedule, model):
  _check(reference, dict(mesh, schedule=schedule), "jit", model)


@pytest.mark.parametrize("mesh,schedule,model", REMAT, ids=_pipe_id)
def test_pipeline_with_remat_matches_single_device(reference, mesh, schedule, model):
  # remat changes what is stashed, not the function: the reference is the model without remat
  _check(reference, dict(mesh, schedule=schedule), "shard_map", model)


@pytest.mark.parametrize("mesh", [pytest.param({"data": 2, "tensor": 4}, marks=pytest.mark.slow),
                                  {"tensor": 2, "pipeline": 2, "microbatches": 2}], ids=str)
def test_tied_embeddings_tensor_parallel(reference, mesh):
  # Tied head under manual TP: each tensor rank's logits come from its vocab rows of the shared (replicated)
  # embedding, vocab-parallel cross-entropy; the table's gradient is summed over the tensor ranks.
  del reference
  tied = {"tie_embeddings": True}
  ref = harness.build({}, "jit", tied)
  state = jax.tree.map(np.asarray, ref.init_state(jax.random.key(1)))
  batch = harness.make_batch(ref.cfg, seed=1)
  want_loss, want_grads = harness.loss_and_grads(ref, state, batch)
  got = harness.build(mesh, "shard_map", tied)
  got_loss, got_grads = harness.loss_and_grads(got, state, batch)
  assert abs(got_loss - want_loss) <= LOSS_TOL["atol"] + LOSS_TOL["rtol"] * abs(want_loss)
  harness.assert_trees_close(got_grads, want_grads, **GRAD_TOL)


# Qwen2 / Llama 3.x shapes: q/k/v biases shard like their projections' heads (they carry the same logical axes),
# RoPE scaling applies at global positions under sequence parallelism. Bands of the llama3 scaling with head_dim 8,
# theta 1e4, original length 64: wavelength 6.3 kept, 63 smoothed, 628 and 6283 divided by the factor.
QKV_BIAS_MODEL = {"qkv_bias": True, "rope_scaling": "llama3", "rope_original_max_len": 64}
QKV_BIAS_LAYOUTS = [
    ({"data": 2, "tensor": 4}, "jit"),
    ({"data": 2, "tensor": 4}, "shard_map"),
    ({"fsdp": 2, "sequence": 2, "tensor": 2}, "shard_map"),
    ({"pipeline": 2, "data": 2, "tensor": 2, "microbatches": 2, "schedule": "1f1b"}, "shard_map"),
]


@pytest.fixture(scope="module")
def qkv_bias_reference():
  """Single-device reference of the biased, RoPE-scaled model, its (zero-initialised) biases drawn at random so
  that a bias applied to the wrong heads changes the loss, not only the gradients."""
  rng = np.random.default_rng(0)
  ref = _own_reference(QKV_BIAS_MODEL)

  def draw(path, a):
    return rng.normal(0.0, 0.5, a.shape).astype(a.dtype) if getattr(path[-1], "key", None) in ("bq", "bk", "bv") else a
  state = ref["state"].replace(params=jax.tree_util.tree_map_with_path(draw, ref["state"].params))
  st = harness.build({}, "jit", QKV_BIAS_MODEL)
  loss, grads = harness.loss_and_grads(st, state, ref["batch"])
  assert abs(loss - ref["loss"]) > 1e-3  # the drawn biases matter
  return {"state": state, "batch": ref["batch"], "loss": loss, "grads": grads}


@pytest.mark.parametrize("mesh,form", QKV_BIAS_LAYOUTS, ids=lambda v: _id(v) if isinstance(v, dict) else v)
def test_qkv_bias_and_rope_scaling_layouts_match_single_device(qkv_bias_reference, mesh, form):
  _check(qkv_bias_reference, mesh, form, QKV_BIAS_MODEL)


def test_fsdp_sequence_rules_shard_every_matrix_over_the_context_ranks():
  """mesh.rules=fsdp_sequence: every matrix with an 'embed' dim is split over fsdp x sequence (torchtitan's
  dp_shard_cp), so its parameters and optimizer state are 1/(fsdp x sequence) per device (the layouts above
  check the step equals one device)."""
  st = harness.build({"fsdp": 2, "sequence": 2, "tensor": 2, "rules": "fsdp_sequence"}, "shard_map")
  matrices = [(jax.tree_util.keystr(p), sh.spec) for p, sh in
              jax.tree_util.tree_leaves_with_path(st.state_shardings.params) if "scale" not in jax.tree_util.keystr(p)]
  assert matrices
  for name, spec in matrices:
    axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
    assert {"fsdp", "sequence"} <= set(axes), (name, spec)
