"""Golden HLO parsing: replica groups in all 3 formats, async pairs, loop trip counts, FLOPs vs hand/XLA."""
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from perfmodel.graph import from_hlo as G
from perfmodel.graph import hlo_parse as hp
from perfmodel.graph import replica_groups as rg
from perfmodel.graph.nodes import COMPUTE_KINDS

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def test_replica_groups_explicit():
  assert rg.parse_replica_groups("{{0,1},{2,3}}") == [(0, 1), (2, 3)]
  assert rg.parse_replica_groups("{}", 4) == [(0, 1, 2, 3)]
  assert rg.parse_replica_groups(None, 2) == [(0, 1)]


def test_replica_groups_iota():
  assert rg.parse_replica_groups("[4,2]<=[8]") == [(0, 1), (2, 3), (4, 5), (6, 7)]
  # reshape [4,2] -> transpose -> [2,4]: groups stride over the first axis
  assert rg.parse_replica_groups("[2,4]<=[4,2]T(1,0)") == [(0, 2, 4, 6), (1, 3, 5, 7)]
  assert rg.parse_replica_groups("[1,8]<=[8]") == [tuple(range(8))]
  assert rg.parse_replica_groups("[2,4]<=[2,2,2]T(1,0,2)") == [(0, 1, 4, 5), (2, 3, 6, 7)]


def test_replica_groups_mesh_axes():
  text = "mesh['axis_0'=4,'axis_1'=2] {'axis_1'}"
  assert rg.parse_replica_groups(text) == [(0, 1), (2, 3), (4, 5), (6, 7)]
  assert rg.parse_replica_groups("mesh['a'=4,'b'=2] {'a'}") == [(0, 2, 4, 6), (1, 3, 5, 7)]
  assert rg.parse_replica_groups("mesh['a'=2,'b'=2,'c'=2] {'a','c'}") == [(0, 1, 4, 5), (2, 3, 6, 7)]
  # sub-axis 'a':(2)2 = the inner half of axis a (size 4 split as 2 x 2)
  assert rg.parse_replica_groups("mesh['a'=4,'b'=2] {'a':(2)2}") == [(0, 2), (1, 3), (4, 6), (5, 7)]


def test_golden_module_async_pairs_loops_and_collectives():
  with open(os.path.join(GOLDEN, "async_gpu.hlo")) as f:
    mod = hp.parse_module(f.read())
  assert mod.entry == "main" and mod.num_partitions == 8
  loop = mod.entry_computation.by_name["loop"]
  assert hp.trip_count(mod, loop) == 12  # from the `i < 12` condition (no known_trip_count)
  g = G.build_graph(mod)
  nodes = {n.name: (n, k) for n, k in g.walk()}
  d, mult = nodes["d"]
  assert d.kind == "dot" and mult == 12 and d.attribution.layer == "layers"
  assert d.attribution.source == "framework/model.py:200"
  ars, _ = nodes["ars"]
  assert ars.collective.kind == "all-reduce" and ars.collective.is_async and ars.collective.group_size == 4
  assert ars.collective.bytes == 16 * 1024 * 2
  ard, _ = nodes["ard"]
  assert ard.kind == "wait" and ard.start == ars.id
  ags, _ = nodes["ags"]
  assert ags.collective.kind == "all-gather" and ags.collective.groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
  assert ags.collective.bytes == 32 * 1024 * 2  # the gathered buffer
  cp, _ = nodes["cp"]
  assert cp.kind == "p2p" and cp.collective.groups()[:2] == [(0, 1), (1, 2)]
  rss, _ = nodes["rss"]
  assert rss.collective.kind == "reduce-scatter" and rss.collective.group_size == 8
  assert rss.collective.bytes == 64 * 1024 * 2
  assert nodes["rsd"][0].kind == "wait" and nodes["rsd"][0].start == rss.id
  # dependencies: the wait of the all-reduce depends (transitively) on the start, and `s` on both
  s, _ = nodes["s"]
  assert ard.id in s.deps and nodes["f"][0].id in s.deps
  # working-set context: every compute node carries the bytes of the program's distinct compute nodes, the
  # loop body's dot counted once (not 12 times)
  compute = {n.name: n for n, _ in g.walk() if n.kind in COMPUTE_KINDS}
  total = sum(n.bytes for n in compute.values())
  assert total > d.bytes > 0 and all(n.program_bytes == total for n in compute.values())
  assert all(n.program_bytes == 0 for n, _ in g.walk() if n.kind not in COMPUTE_KINDS)


def _mesh():
  return jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_compiled_scan_trip_counts_and_flops_match_hand_count():
  L, B, D = 5, 16, 64
  mesh = _mesh()

  def f(x, w):
    y, _ = jax.lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), x, w)
    return (y ** 2).sum()
  x = jax.ShapeDtypeStruct((B, D), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
  w = jax.ShapeDtypeStruct((L, D, D), jnp.float32, sharding=NamedSharding(mesh, P(None, None, "tensor")))
  comp = jax.jit(jax.grad(f, argnums=1)).lower(x, w).compile()
  g = G.from_hlo_text(comp.as_text())
  loops = [n for n, _ in g.walk() if n.kind == "loop"]
  assert sorted(n.trip_count for n in loops) == [L, L]
  # per device: B/4 rows, D/2 output columns; fwd 1 dot + bwd 2 dots per layer
  hand = L * 3 * 2 * (B // 4) * D * (D // 2)
  dot_flops = sum(n.flops * k for n, k in g.walk() if n.kind == "dot")
  assert dot_flops == hand
  # XLA counts loop bodies once: our count with multiplicity is ~L x its count
  xla = comp.cost_analysis()
  xla = xla[0] if isinstance(xla, list) else xla
  once = sum(n.flops for n, _ in g.walk() if n.kind == "dot")
  assert once == pytest.approx(hand / L)
  assert xla["flops"] == pytest.approx(once, rel=0.1)
  kinds = {n.collective.kind for n, _ in g.walk() if n.collective}
  assert "all-reduce" in kinds


def test_plain_matmul_flops_equal_xla():
  a = jax.ShapeDtypeStruct((128, 256), jnp.float32)
  b = jax.ShapeDtypeStruct((256, 64), jnp.float32)
  comp = jax.jit(lambda x, y: x @ y).lower(a, b).compile()
  g = G.from_hlo_text(comp.as_text())
  xla = comp.cost_analysis()
  xla = xla[0] if isinstance(xla, list) else xla
  assert g.totals()["flops"] == 2 * 128 * 256 * 64 == xla["flops"]


def test_bare_mesh_replica_groups_mean_the_whole_mesh():
  assert rg.parse_replica_groups("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4]") == [tuple(range(8))]


def test_a_computation_closed_with_attributes_ends_there():
  """TPU prints a SparseCore computation's closing brace with attributes; the next computation is its own."""
  text = """HloModule m, num_partitions=1

%sc_body (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p)
}, execution_thread="sparsecore"

%fused_computation.1 (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  ROOT %e = f32[8]{0} exponential(%q)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %f = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1
}
"""
  mod = hp.parse_module(text)
  assert set(mod.computations) == {"sc_body", "fused_computation.1", "main"}
  assert [i.opcode for i in mod.computations["fused_computation.1"].instructions] == ["parameter", "exponential"]
  assert [n.transcendentals for n, _ in G.build_graph(mod).walk()] == [8]  # the fusion reads its own computation


def test_a_stacked_operand_read_through_a_bitcast_reads_its_slice_only():
  """A scanned layer's weight is one slice of the stacked [L, ...] array: a fusion that bitcasts the stack and
  dynamic-slices one layer out reads that layer (not L layers); a root dynamic-update-slice into a bitcast of
  its buffer writes the update only and reads nothing of the buffer."""
  text = """HloModule m, num_partitions=1

%read (p0: s32[], p1: bf16[32,64,128]) -> f32[128,64] {
  %p1 = bf16[32,64,128]{1,0,2} parameter(1)
  %b = bf16[128,32,64]{2,1,0} bitcast(%p1)
  %z = s32[] constant(0)
  %p0 = s32[] parameter(0)
  %ds = bf16[128,1,64]{2,1,0} dynamic-slice(%b, %z, %p0, %z), dynamic_slice_sizes={128,1,64}
  %c = f32[128,1,64]{2,1,0} convert(%ds)
  ROOT %r = f32[128,64]{1,0} bitcast(%c)
}

%write (q0: s32[], q1: bf16[32,1,64,128], q2: bf16[64,128]) -> bf16[128,32,1,64] {
  %q1 = bf16[32,1,64,128]{2,1,0,3} parameter(1)
  %bb = bf16[128,32,1,64]{3,2,1,0} bitcast(%q1)
  %q2 = bf16[64,128]{0,1} parameter(2)
  %u = bf16[128,1,1,64]{3,2,1,0} bitcast(%q2)
  %zz = s32[] constant(0)
  %q0 = s32[] parameter(0)
  ROOT %d = bf16[128,32,1,64]{3,2,1,0} dynamic-update-slice(%bb, %u, %zz, %q0, %zz, %zz)
}

ENTRY %main (i: s32[], w: bf16[32,64,128], buf: bf16[32,1,64,128], g: bf16[64,128]) -> (f32[128,64], bf16[128,32,1,64]) {
  %i = s32[] parameter(0)
  %w = bf16[32,64,128]{1,0,2} parameter(1)
  %buf = bf16[32,1,64,128]{2,1,0,3} parameter(2)
  %g = bf16[64,128]{0,1} parameter(3)
  %f1 = f32[128,64]{1,0} fusion(%i, %w), kind=kLoop, calls=%read
  %f2 = bf16[128,32,1,64]{3,2,1,0} fusion(%i, %buf, %g), kind=kLoop, calls=%write
  ROOT %t = (f32[128,64]{1,0}, bf16[128,32,1,64]{3,2,1,0}) tuple(%f1, %f2)
}
"""
  nodes = {n.name: n for n, _ in G.build_graph(hp.parse_module(text)).walk()}
  layer = 64 * 128
  assert nodes["f1"].bytes == 4 + 2 * layer + 4 * layer  # index + one bf16 layer read + its f32 written
  assert nodes["f2"].bytes == 4 + 2 * layer + 2 * layer  # index + the update read + the update written


def test_picking_a_layer_of_a_stacked_array_costs_nothing_only_where_the_framework_keeps_layers_apart():
  """A fusion that only dynamic-slices one layer out of a stack (scalar index arithmetic aside) is indexing; one
  that also converts it is work. A PyTorch framework (its layers' tensors apart) runs no such copy; XLA does."""
  from perfmodel.cost import chain as chain_lib
  from perfmodel.hardware import load as load_profile
  text = """HloModule m, num_partitions=1

%pick (p0: s32[], p1: bf16[32,64,128]) -> bf16[1,64,128] {
  %p1 = bf16[32,64,128]{2,1,0} parameter(1)
  %p0 = s32[] parameter(0)
  %z = s32[] constant(0)
  %n = s32[] constant(32)
  %lt = pred[] compare(%p0, %z), direction=LT
  %w = s32[] add(%p0, %n)
  %i = s32[] select(%lt, %w, %p0)
  ROOT %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%p1, %i, %z, %z), dynamic_slice_sizes={1,64,128}
}

%work (q0: s32[], q1: bf16[32,64,128]) -> f32[1,64,128] {
  %q1 = bf16[32,64,128]{2,1,0} parameter(1)
  %q0 = s32[] parameter(0)
  %zz = s32[] constant(0)
  %ds2 = bf16[1,64,128]{2,1,0} dynamic-slice(%q1, %q0, %zz, %zz), dynamic_slice_sizes={1,64,128}
  ROOT %c = f32[1,64,128]{2,1,0} convert(%ds2)
}

%keep (k0: s32[], k1: bf16[32,64,128], k2: pred[], k3: bf16[1,64,128]) -> bf16[32,64,128] {
  %k1 = bf16[32,64,128]{2,1,0} parameter(1)
  %k2 = pred[] parameter(2)
  %kb = pred[1,64,128]{2,1,0} broadcast(%k2), dimensions={}
  %k0 = s32[] parameter(0)
  %kz = s32[] constant(0)
  %old = bf16[1,64,128]{2,1,0} dynamic-slice(%k1, %k0, %kz, %kz), dynamic_slice_sizes={1,64,128}
  %k3 = bf16[1,64,128]{2,1,0} parameter(3)
  %sel = bf16[1,64,128]{2,1,0} select(%kb, %k3, %old)
  ROOT %dus = bf16[32,64,128]{2,1,0} dynamic-update-slice(%k1, %sel, %k0, %kz, %kz)
}

%mask (m0: s32[], m1: bf16[32,64,128], m2: pred[128], m3: bf16[1,64,128]) -> bf16[32,64,128] {
  %m1 = bf16[32,64,128]{2,1,0} parameter(1)
  %m2 = pred[128]{0} parameter(2)
  %mb = pred[1,64,128]{2,1,0} broadcast(%m2), dimensions={2}
  %m0 = s32[] parameter(0)
  %mz = s32[] constant(0)
  %mold = bf16[1,64,128]{2,1,0} dynamic-slice(%m1, %m0, %mz, %mz), dynamic_slice_sizes={1,64,128}
  %m3 = bf16[1,64,128]{2,1,0} parameter(3)
  %msel = bf16[1,64,128]{2,1,0} select(%mb, %m3, %mold)
  ROOT %mdus = bf16[32,64,128]{2,1,0} dynamic-update-slice(%m1, %msel, %m0, %mz, %mz)
}

ENTRY %main (i: s32[], w: bf16[32,64,128], p: pred[], q: pred[128], u: bf16[1,64,128]) -> (bf16[1,64,128], f32[1,64,128], bf16[32,64,128], bf16[32,64,128]) {
  %i = s32[] parameter(0)
  %w = bf16[32,64,128]{2,1,0} parameter(1)
  %p = pred[] parameter(2)
  %q = pred[128]{0} parameter(3)
  %u = bf16[1,64,128]{2,1,0} parameter(4)
  %f1 = bf16[1,64,128]{2,1,0} fusion(%i, %w), kind=kLoop, calls=%pick
  %f2 = f32[1,64,128]{2,1,0} fusion(%i, %w), kind=kLoop, calls=%work
  %f3 = bf16[32,64,128]{2,1,0} fusion(%i, %w, %p, %u), kind=kLoop, calls=%keep
  %f4 = bf16[32,64,128]{2,1,0} fusion(%i, %w, %q, %u), kind=kLoop, calls=%mask
  ROOT %t = (bf16[1,64,128]{2,1,0}, f32[1,64,128]{2,1,0}, bf16[32,64,128]{2,1,0}, bf16[32,64,128]{2,1,0}) tuple(%f1, %f2, %f3, %f4)
}
"""
  nodes = {n.name: n for n, _ in G.build_graph(hp.parse_module(text)).walk()}
  assert nodes["f1"].indexing and not nodes["f2"].indexing
  # a write kept or not by one scalar predicate (a pipeline tick's stash slot) moves data; a mask per element works
  assert nodes["f3"].indexing and not nodes["f4"].indexing
  hw = load_profile("h100")
  apart, stacked = chain_lib.make_chain(hw, framework="megatron"), chain_lib.make_chain(hw, framework="maxtext")
  assert apart.price(nodes["f1"]).seconds == 0.0 < stacked.price(nodes["f1"]).seconds
  assert apart.price(nodes["f2"]).seconds == stacked.price(nodes["f2"]).seconds > 0.0
