"""Megatron sequence parallelism of the tensor axis (mesh.tensor_sequence_parallel): the same loss and gradients as
one device (norm scales and embedding included, whose gradients are partial per tensor rank), a program whose
row-parallel epilogues are reduce-scatters, and less activation memory, measured."""
import jax
import pytest

from parallelism import stash
from tests.parallelism import harness
from tests.parallelism.test_layouts import _check, _id, _own_reference, _pipe_id

SP = {"tensor_sequence_parallel": True}
S = pytest.mark.slow
LAYOUTS = [  # (mesh, model overrides); all shard_map. Slow: same code paths as the default set, other mixes.
    ({"data": 2, "tensor": 2}, None),
    ({"data": 2, "fsdp": 2, "tensor": 2}, None),
    ({"data": 2, "sequence": 2, "tensor": 2}, None),
    ({"data": 2, "tensor": 4}, {"tie_embeddings": True}),  # replicated head: its input is gathered as replicated
    pytest.param({"data": 2, "tensor": 4}, {"block": "parallel"}, marks=S),
    pytest.param({"fsdp": 2, "sequence": 2, "tensor": 2}, {"attention": "ring"}, marks=S),
    ({"pipeline": 2, "data": 2, "tensor": 2, "microbatches": 2, "schedule": "1f1b"}, None),
    pytest.param({"pipeline": 2, "tensor": 4, "microbatches": 2, "schedule": "1f1b"}, {"remat": "full"}, marks=S),
    pytest.param({"pipeline": 2, "fsdp": 2, "tensor": 2, "microbatches": 4, "virtual_stages": 2, "schedule": "gpipe"},
                 None, marks=S),
]


@pytest.mark.parametrize("mesh,model", LAYOUTS, ids=_pipe_id)
def test_sequence_parallel_layout_matches_single_device(reference, mesh, model):
  # remat changes what is kept, not the function: the reference is the model without it
  own = model and set(model) != {"remat"}
  _check(_own_reference(model) if own else reference, dict(mesh, **SP), "shard_map", model)


def _jaxpr(mesh, sp: bool) -> str:
  st = harness.build(dict(mesh, tensor_sequence_parallel=sp), "shard_map")
  state, batch = st.abstract_state(), st.abstract_batch()
  with st.context():
    return str(jax.make_jaxpr(st.loss_and_grads)(state.params, batch["inputs"], batch["targets"]))


def test_row_parallel_epilogue_is_a_reduce_scatter():
  # data x tensor has no FSDP gradient reduce-scatter: every reduce_scatter in the program is sequence parallelism's
  mesh = {"data": 2, "tensor": 2}
  off, on = _jaxpr(mesh, False), _jaxpr(mesh, True)
  assert "reduce_scatter" not in off and "reduce_scatter" in on
  assert on.count("all_gather") > off.count("all_gather")


def _stash_avals(monkeypatch, mesh, remat: str, sp: bool):
  """The residuals one pipeline unit stashes (per device), as the step traces them."""
  built = []
  init = stash.SplitVjp.__init__

  def spy(self, *a, **k):
    init(self, *a, **k)
    built.append(self)
  monkeypatch.setattr(stash.SplitVjp, "__init__", spy)
  st = harness.build(dict(mesh, tensor_sequence_parallel=sp), "shard_map", {"remat": remat, "d_model": 128,
                                                                             "max_seq_len": 64}, {"seq_len": 64})
  state, batch = st.abstract_state(), st.abstract_batch()
  with st.context():
    jax.jit(st.loss_and_grads).trace(state.params, batch["inputs"], batch["targets"])
  return built[0].stash_avals


def test_pipeline_stash_holds_the_sequence_chunk(monkeypatch):
  mesh = {"pipeline": 2, "tensor": 4, "microbatches": 2, "schedule": "1f1b"}
  t, d, tp = 64, 128, 4
  nbytes = lambda avals: sum(a.size * a.dtype.itemsize for a in avals)  # noqa: E731
  # remat=full keeps each layer's input: the residual stream, a quarter of the sequence per device
  full_off, full_on = _stash_avals(monkeypatch, mesh, "full", False), _stash_avals(monkeypatch, mesh, "full", True)
  assert [a.shape[2:] for a in full_off] == [(t, d)] and [a.shape[2:] for a in full_on] == [(t // tp, d)]
  assert nbytes(full_on) * tp == nbytes(full_off)
  # remat=minimal keeps the named projections; the all-gathered (whole-sequence) norm outputs are recomputed
  min_off, min_on = _stash_avals(monkeypatch, mesh, "minimal", False), _stash_avals(monkeypatch, mesh, "minimal", True)
  assert any(a.shape[2:] == (t, d) for a in min_off)
  assert not any(a.shape[2:] == (t, d) for a in min_on)
  assert nbytes(min_on) < nbytes(min_off)


def _temp_bytes(mesh, model, data, sp: bool) -> int:
  st = harness.build(dict(mesh, tensor_sequence_parallel=sp), "shard_map", model, data)
  state, batch = st.abstract_state(), st.abstract_batch()
  with st.context():
    compiled = jax.jit(st.loss_and_grads).lower(state.params, batch["inputs"], batch["targets"]).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_temp_memory_shrinks_by_the_stash_saving():
  # tensor 4 x pipeline 2, 1F1B over 4 micro-batches of 2 rows: min(M, 2P-1) = 3 stash slots, each holding the
  # inputs of the stage's 2 layers (remat=full). Sequence parallelism stores 1/4 of each: the compiler's temp
  # memory must drop by at least the 3/4 of that stash it no longer holds (float32).
  mesh = {"pipeline": 2, "tensor": 4, "microbatches": 4, "schedule": "1f1b"}
  t, d = 512, 128
  model, data = {"remat": "full", "d_model": d, "max_seq_len": t}, {"seq_len": t, "global_batch": 8}
  stash_bytes = 3 * 2 * 2 * t * d * 4
  off, on = _temp_bytes(mesh, model, data, False), _temp_bytes(mesh, model, data, True)
  assert off - on >= stash_bytes * 3 // 4, (off, on)
