"""Exposed communication: the part of an async transfer the compute stream waits for (perfmodel/timeline.py).

Synthetic graphs with hand-computed timelines (no overlap possible, full overlap, partial overlap), and a real
program compiled for 8 compile-only H100s whose exposed communication must equal its makespan less its compute.
"""
import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from framework.config import from_dict, validate
from parallelism import targets
from perfmodel import hardware
from perfmodel import predict as pr
from perfmodel.cost import collectives as C
from perfmodel.cost import chain as chain_lib
from perfmodel.cost.chain import Chain
from perfmodel.cost.physical import Roofline
from perfmodel.graph import from_hlo
from perfmodel.graph.nodes import Attribution, CollectiveInfo, DotInfo, ExecGraph, Node, Region
from perfmodel.hardware import HardwareProfile, LinkLevel
from perfmodel.timeline import Overlap, schedule

HAS_CUDA = importlib.util.find_spec("jax_plugins") is not None and \
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
MS = 1e-3


def _chain():
  hw = HardwareProfile(name="t", device_kind="t", peak_flops={"f32": 1e12}, mem_bandwidth=1e12, mem_bytes=1e9,
                       launch_overhead=0.0, links=(LinkLevel("l", 0, 1e9, 0.0),))
  return Chain([Roofline(hw)], hw)


def _comp(i, ms, deps):  # a fusion of ms milliseconds at 1 TB/s
  return Node(id=i, name=f"c{i}", kind="fusion", opcode="fusion", bytes=ms * 1e9, deps=deps)


def _program(independent_ms: float):
  """c0 (1 ms) -> all-reduce start; ``independent_ms`` of compute that does not read the transfer; the wait; c9
  (1 ms) reads the result. The all-reduce moves 2 MB between 2 devices at 1 GB/s: a 2 ms ring (S/B)."""
  info = CollectiveInfo("all-reduce", 2, 1, 2e6, "{{0,1}}", is_async=True, n_devices=2)
  nodes = [_comp(0, 1.0, ()), Node(id=1, name="ar", kind="collective", opcode="all-reduce-start", deps=(0,),
                                   collective=info)]
  if independent_ms:
    nodes.append(_comp(2, independent_ms, (0,)))
  nodes += [Node(id=3, name="w", kind="wait", opcode="all-reduce-done", deps=(1,), start=1), _comp(9, 1.0, (3,))]
  return ExecGraph({"e": Region("e", nodes)}, "e", 2)


def test_the_priced_transfer_is_two_milliseconds():
  assert C.ring_all_reduce(2e6, 2, 1e9, 0.0) == pytest.approx(2 * MS)


@pytest.mark.parametrize("independent_ms,exposed_ms,makespan_ms", [
    (0.0, 2.0, 4.0),  # nothing to overlap with: the whole transfer is a stall
    (0.5, 1.5, 4.0),  # partial: 0.5 ms hidden
    (2.0, 0.0, 4.0),  # exactly as long as the transfer: all hidden
    (3.0, 0.0, 5.0),  # longer: all hidden, the compute sets the step
])
def test_exposed_communication_is_the_stall_a_wait_causes(independent_ms, exposed_ms, makespan_ms):
  tl = schedule(_program(independent_ms), _chain())
  assert tl.exposed_comm == pytest.approx(exposed_ms * MS)
  assert tl.makespan == pytest.approx(makespan_ms * MS)
  assert tl.makespan == pytest.approx(2 * MS + independent_ms * MS + tl.exposed_comm)


def test_a_wait_with_other_inputs_stalls_only_past_them():
  """A wait that also reads a compute node ends no earlier than that node; only the transfer beyond it is
  exposed."""
  g = _program(0.5)
  nodes = g.regions["e"].nodes
  nodes[3] = Node(id=3, name="w", kind="wait", opcode="all-reduce-done", deps=(1, 2), start=1)
  tl = schedule(g, _chain())
  assert tl.exposed_comm == pytest.approx(1.5 * MS)


@pytest.mark.skipif(not HAS_CUDA, reason="needs the CUDA plugin (pip install -e '.[tpu-aot]')")
def test_a_compiled_gpu_program_exposes_what_its_makespan_adds_to_its_compute():
  """8 compile-only H100s, a data-parallel gradient step: the gradient all-reduce at the end has nothing after it to
  overlap with, so it is exposed; every stall the compute stream sees is counted once."""
  mesh = Mesh(np.array(targets.compile_only_devices("h100", 8)), ("d",))

  def grads(w1, w2, x):
    return jax.grad(lambda a, b: jnp.sum(jnp.tanh(x @ a) @ b) ** 2, argnums=(0, 1))(w1, w2)

  sd = lambda s, spec: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))  # noqa: E731
  text = jax.jit(grads).lower(sd((2048, 2048), P()), sd((2048, 2048), P()),
                              sd((8192, 2048), P("d", None))).compile().as_text()
  g = from_hlo.from_hlo_text(text, 8)
  waits = [n for n, _ in g.walk() if n.kind == "wait"]
  assert waits, "the GPU program has async collectives"
  chain = chain_lib.make_chain(hardware.load("h100"))
  tl = schedule(g, chain)
  compute = sum(v for k, v in tl.busy_by_kind.items() if k not in ("collective", "p2p"))
  last = [n for n in g.regions[g.entry].nodes if n.collective is not None][-1]
  assert tl.exposed_comm >= chain.price(last).seconds > 0
  assert tl.exposed_comm == pytest.approx(tl.makespan - compute, rel=1e-9)


def test_tpu_async_collective_fusions_are_an_async_transfer_and_its_wait():
  """XLA:TPU fuses an all-gather into a start fusion, steps fused with compute, and a done fusion
  (golden/tpu_async_collective_fusion.hlo, the shape of libtpu's output): one async all-gather of the gathered
  bytes, the step priced as its matmul only, the done a wait on that start; the transfer hides behind the step's
  matmul and only the rest is exposed."""
  with open(os.path.join(os.path.dirname(__file__), "golden", "tpu_async_collective_fusion.hlo")) as f:
    g = from_hlo.from_hlo_text(f.read())
  nodes = {n.name: n for n, _ in g.walk()}
  start, step, done = nodes["async-collective-start"], nodes["fusion.1"], nodes["async-collective-done"]
  info = start.collective
  assert (info.kind, info.is_async, info.group_size, info.bytes) == ("all-gather", True, 4, 1024 * 1024 * 2)
  assert done.kind == "wait" and done.start == start.id
  assert step.kind == "dot" and step.flops == 2 * 4096 * 1024 * 1024
  hw = HardwareProfile(name="t", device_kind="t", peak_flops={"bf16": 1e13, "f32": 1e12}, mem_bandwidth=1e12,
                       mem_bytes=1e9, launch_overhead=0.0, links=(LinkLevel("l", 0, 1e9, 0.0),))
  t_ag = 3 / 4 * 2 * 1024 * 1024 / 1e9  # ring all-gather over 4 at 1 GB/s
  t_mm = 2 * 4096 * 1024 * 1024 / 1e13
  tl = schedule(g, Chain([Roofline(hw)], hw))
  assert tl.exposed_comm == pytest.approx(t_ag - t_mm)
  assert tl.makespan == pytest.approx(t_ag + t_mm)


# ---------------------------------------------------------------- Megatron's overlap options (timeline.Overlap)

SIZES = (("data", 2), ("tensor", 2))  # partition id = 2 * data + tensor
TP, DP = "{{0,1},{2,3}}", "{{0,2},{1,3}}"


def _coll(i, kind, groups, mb, deps, phase="fwd"):
  """A synchronous collective over 2 devices moving ``mb`` MB: at 1 GB/s an all-reduce takes mb ms, an all-gather
  mb / 2 ms."""
  info = CollectiveInfo(kind, 2, 2, mb * 1e6, groups, is_async=False, n_devices=4)
  return Node(id=i, name=f"{kind}{i}", kind="collective", opcode=kind, deps=deps, collective=info,
              attribution=Attribution(phase=phase))


def _dot(i, ms, deps):
  return Node(id=i, name=f"d{i}", kind="dot", opcode="dot", flops=ms * 1e9, deps=deps,
              dot=DotInfo(1, 1, 1, 1, "f32"))


def test_overlap_options_see_which_mesh_axes_a_collective_spans():
  ov = Overlap(sizes=SIZES)
  assert ov.axes(_coll(0, "all-reduce", TP, 1, ()).collective) == {"tensor"}
  assert ov.axes(_coll(0, "all-reduce", DP, 1, ()).collective) == {"data"}


@pytest.mark.parametrize("comm_mb,exposed_ms", [(1.5, 0.0), (3.0, 1.0)])
def test_tp_comm_overlap_hides_a_tensor_collective_behind_the_matmul_that_produces_it(comm_mb, exposed_ms):
  """In a layer (a loop body): a 2 ms matmul, its tensor-parallel all-reduce, the consumer (1 ms). Pipelined with
  the matmul, the transfer is exposed only beyond it; without the option it is all exposed."""
  body = [_dot(0, 2.0, ()), _coll(1, "all-reduce", TP, comm_mb, (0,)), _comp(2, 1.0, (1,))]
  g = ExecGraph({"e": Region("e", [Node(id=9, name="loop", kind="loop", opcode="while", body="b", trip_count=3)]),
                 "b": Region("b", body)}, "e", 4)
  on = schedule(g, _chain(), overlap=Overlap(tp_comm=True, sizes=SIZES))
  off = schedule(g, _chain())
  assert on.exposed_comm == pytest.approx(3 * exposed_ms * MS)
  assert on.makespan == pytest.approx(3 * (3.0 + exposed_ms) * MS)
  assert off.exposed_comm == pytest.approx(3 * comm_mb * MS)
  assert off.makespan == pytest.approx(3 * (3.0 + comm_mb) * MS)


def _step(grad_mb=3.0, param_mb=0.0, param_async=False):
  """The backward loop (4 ms), the data-parallel gradient all-reduce, the optimizer (1 ms) reading it, then the
  data-parallel all-gather of the updated parameters (distributed optimizer; async: a start and its wait)."""
  nodes = [Node(id=0, name="bwd", kind="loop", opcode="while", body="b", trip_count=1),
           _coll(1, "all-reduce", DP, grad_mb, (0,), "bwd"), _comp(2, 1.0, (1,))]
  if param_mb:
    ag = _coll(3, "all-gather", DP, param_mb, (2,), "opt")
    if param_async:
      ag = dataclasses.replace(ag, collective=dataclasses.replace(ag.collective, is_async=True))
      nodes += [ag, Node(id=4, name="agd", kind="wait", opcode="all-gather-done", deps=(3,), start=3)]
    else:
      nodes.append(ag)
  return ExecGraph({"e": Region("e", nodes), "b": Region("b", [_comp(5, 4.0, ())])}, "e", 4)


def test_grad_reduce_overlaps_the_last_micro_batch_backward_but_not_the_last_bucket():
  """A 3 ms gradient all-reduce behind a 2 ms backward window starts 2 ms before the backward ends: the optimizer
  waits 1 ms. With a bucket of half the gradients the last half (1.5 ms) starts only at the end: 1.5 ms."""
  ov = Overlap(grad_reduce=True, sizes=SIZES, bwd_window_s=2 * MS)
  tl = schedule(_step(), _chain(), overlap=ov)
  assert tl.exposed_comm == pytest.approx(1 * MS) and tl.makespan == pytest.approx(6 * MS)
  half = schedule(_step(), _chain(), overlap=Overlap(grad_reduce=True, sizes=SIZES, bwd_window_s=2 * MS,
                                                     bucket_fraction=0.5))
  assert half.exposed_comm == pytest.approx(1.5 * MS) and half.makespan == pytest.approx(6.5 * MS)
  off = schedule(_step(), _chain())
  assert off.exposed_comm == pytest.approx(3 * MS) and off.makespan == pytest.approx(8 * MS)


@pytest.mark.parametrize("param_async", [False, True])
@pytest.mark.parametrize("fwd_ms,bucket,tail_ms", [(1.5, 0.1, 0.5), (3.0, 0.1, 0.2), (3.0, 0.0, 0.0)])
def test_param_gather_overlaps_the_next_steps_first_forward(fwd_ms, bucket, tail_ms, param_async):
  """A 2 ms parameter all-gather (4 MB) after the optimizer, read by the next step's forward: the step is longer by
  what the transfer outlasts the first micro-batch's forward, and at least by the first bucket's transfer."""
  ov = Overlap(param_gather=True, sizes=SIZES, fwd_window_s=fwd_ms * MS, bucket_fraction=bucket)
  tl = schedule(_step(grad_mb=0.001, param_mb=4.0, param_async=param_async), _chain(), overlap=ov)
  base = 4.0 + 0.001 + 1.0
  assert tl.exposed_comm == pytest.approx((0.001 + tail_ms) * MS)
  assert tl.makespan == pytest.approx((base + tail_ms) * MS)


def test_a_framework_spec_selects_the_overlap_options_predict_models():
  cfg = validate(from_dict({"mesh": {"data": 2, "tensor": 2}}), 4)
  every = pr._overlap(cfg, "megatron", 1.0, 2.0)  # noqa: SLF001
  assert (every.tp_comm, every.grad_reduce, every.param_gather) == (True, True, True)
  assert pr._overlap(cfg, "megatron:none", 1.0, 2.0) is None  # noqa: SLF001
  assert pr._overlap(cfg, "maxtext", 1.0, 2.0) is None  # noqa: SLF001 - XLA's scheduler, no Megatron options
  only = pr._overlap(cfg, "torchtitan:tp_comm", 1.0, 2.0)  # noqa: SLF001
  assert (only.tp_comm, only.grad_reduce, only.param_gather) == (True, False, False)
  assert "framework spec" in pr._overlap_info(only, "torchtitan:tp_comm")["source"]  # noqa: SLF001
