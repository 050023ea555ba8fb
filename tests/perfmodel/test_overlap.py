"""Exposed communication: the part of an async transfer the compute stream waits for (perfmodel/timeline.py).

Synthetic graphs with hand-computed timelines (no overlap possible, full overlap, partial overlap), and a real
program compiled for 8 compile-only H100s whose exposed communication must equal its makespan less its compute.
"""
import importlib.util

import pytest

from perfmodel.cost import collectives as C
from perfmodel.cost.chain import Chain
from perfmodel.cost.physical import Roofline
from perfmodel.graph.nodes import CollectiveInfo, ExecGraph, Node, Region
from perfmodel.hardware import HardwareProfile, LinkLevel
from perfmodel.timeline import schedule

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
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from parallelism import targets
  from perfmodel import hardware
  from perfmodel.cost import chain as chain_lib
  from perfmodel.graph import from_hlo

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
