"""Layout changes that move the minor-most dimension, and the learned backend's node classes built on them."""
import jax
import jax.numpy as jnp

from perfmodel.calib import refit, runners, suite
from perfmodel.cost import learned
from perfmodel.graph import from_hlo as G
from perfmodel.graph import hlo_parse as hp
from perfmodel.graph.nodes import Node

# Two fusions from a compiled training step (XLA:CPU, trimmed): the first gathers its minor dimension with a
# stride (a transpose with layout {0,2,1}, then a copy to row-major), the second keeps the minor dimension
# (it swaps two outer ones); and a standalone copy that changes the layout of a 2-D array.
MODULE = """HloModule m, entry_computation_layout={(f32[8,128,384]{2,1,0})->f32[384,1024]{1,0}}

%strided (p0: f32[8,128,384]) -> f32[384,1024] {
  %p0 = f32[8,128,384]{2,1,0} parameter(0)
  %t = f32[384,8,128]{0,2,1} transpose(%p0), dimensions={2,0,1}
  %c = f32[384,8,128]{2,1,0} copy(%t)
  ROOT %b = f32[384,1024]{1,0} bitcast(%c)
}

%contiguous (q0: f32[8,2,2,128,128]) -> f32[8,2,256,128] {
  %q0 = f32[8,2,2,128,128]{4,3,2,1,0} parameter(0)
  %t2 = f32[8,2,128,2,128]{4,2,3,1,0} transpose(%q0), dimensions={0,1,3,2,4}
  %c2 = f32[8,2,128,2,128]{4,3,2,1,0} copy(%t2)
  ROOT %b2 = f32[8,2,256,128]{3,2,1,0} bitcast(%c2)
}

ENTRY %main (x: f32[8,128,384], y: f32[8,2,2,128,128], z: f32[64,32]) -> f32[384,1024] {
  %x = f32[8,128,384]{2,1,0} parameter(0)
  %y = f32[8,2,2,128,128]{4,3,2,1,0} parameter(1)
  %z = f32[64,32]{1,0} parameter(2)
  %copy_bitcast_fusion.4 = f32[384,1024]{1,0} fusion(%x), kind=kLoop, calls=%strided
  %copy_bitcast_fusion.12 = f32[8,2,256,128]{3,2,1,0} fusion(%y), kind=kLoop, calls=%contiguous
  %copy.7 = f32[64,32]{0,1} copy(%z)
  %copy.8 = f32[64,32]{1,0} copy(%z)
  ROOT %r = f32[384,1024]{1,0} copy(%copy_bitcast_fusion.4)
}
"""


def _nodes():
  g = G.from_hlo_text(MODULE, 1)
  return {n.name: n for n, _ in g.walk()}


def test_layout_is_read_from_the_printed_shape_or_row_major():
  ins = hp.parse_instruction("%t = f32[384,8,128]{0,2,1} transpose(%p0), dimensions={2,0,1}")
  assert ins.minor_to_major == (0, 2, 1)
  assert hp.parse_instruction("%a = f32[4,5,6] add(%x, %y)").minor_to_major == (2, 1, 0)
  assert hp.parse_instruction("%t = f32[8,128]{1,0:T(8,128)} copy(%x)").minor_to_major == (1, 0)


def test_a_layout_change_moves_the_minor_dimension_or_keeps_it():
  n = _nodes()
  assert n["copy_bitcast_fusion.4"].moves_minor  # the copy reads the minor dim with a stride of 384 floats
  assert not n["copy_bitcast_fusion.12"].moves_minor  # rows of 128 floats stay contiguous
  assert n["copy.7"].moves_minor  # row-major -> column-major
  assert not n["copy.8"].moves_minor  # same layout: a plain copy


def test_the_minor_dimension_ignores_dimensions_of_size_one():
  # [1,64] -> [64,1] moves nothing physically: the only dimension of size > 1 stays minor-most
  mod = """HloModule m
ENTRY %main (x: f32[1,64]) -> f32[64,1] {
  %x = f32[1,64]{1,0} parameter(0)
  ROOT %t = f32[64,1]{1,0} transpose(%x), dimensions={1,0}
}
"""
  (node,) = [n for n, _ in G.from_hlo_text(mod, 1).walk()]
  assert not node.moves_minor


def test_node_classes_split_plain_dots_and_minor_moving_layout_changes():
  n = _nodes()
  assert learned.node_class(n["copy_bitcast_fusion.4"]) == "fusion:kLoop/minor"
  assert learned.node_class(n["copy_bitcast_fusion.12"]) == "fusion:kLoop"
  assert learned.node_class(n["copy.7"]) == "copy/minor"
  assert learned.node_class(n["copy.8"]) == "copy"
  plain = Node(id=1, name="dot.3", kind="dot", opcode="dot")
  library = Node(id=2, name="ynn_fusion.3", kind="dot", opcode="fusion:kCustom")
  assert learned.node_class(plain) == "dot:plain" and learned.node_class(library) == "dot"


def test_a_compiled_transpose_is_analysed_like_the_golden_one():
  # the real compiler's output for a minor-moving transpose, whatever fusion it picks
  f = jax.jit(lambda x: (x * 2.0).T)
  text = f.lower(jnp.ones((64, 48))).compile().as_text()
  g = G.from_hlo_text(text, 1)
  assert any(n.moves_minor for n, _ in g.walk() if n.kind in ("fusion", "other"))
  f2 = jax.jit(lambda x: x * 2.0 + 1.0)
  g2 = G.from_hlo_text(f2.lower(jnp.ones((64, 48))).compile().as_text(), 1)
  assert not any(n.moves_minor for n, _ in g2.walk())


def test_refit_rederives_sample_classes_and_drops_changed_nodes():
  nodes = _nodes()
  g = G.from_hlo_text(MODULE, 1)
  fp4 = nodes["copy_bitcast_fusion.4"].fingerprint
  samples = [
      {"prog": "p", "name": "copy_bitcast_fusion.4", "fp": fp4, "cls": "fusion:kLoop", "f": [0.0], "t": 1e-3,
       "phys": 1e-4, "P": 0.0},
      {"prog": "p", "name": "copy_bitcast_fusion.12", "fp": "something else", "cls": "fusion:kLoop", "f": [0.0],
       "t": 1e-3, "phys": 1e-4, "P": 0.0},  # the program compiled now differs: dropped
      {"prog": "p", "name": "gone.1", "fp": "", "cls": "op", "f": [0.0], "t": 1e-3, "phys": 1e-4, "P": 0.0},
  ]
  out, dropped = refit.refresh_samples(samples, {"p": g})
  assert dropped == 2 and len(out) == 1 and out[0]["fp"] == fp4
  assert out[0]["cls"] == "fusion:kLoop/minor"
  assert out[0]["f"] == learned.features(nodes["copy_bitcast_fusion.4"])
  assert out[0]["t"] == 1e-3  # the measurement is kept


def test_calibration_programs_are_disjoint_from_the_validation_suite():
  """validate is a held-out test only if no calibration program is a validation config (same model, tokens and
  mesh), whatever its name."""
  def key(cfg):
    m, d = cfg.model, cfg.data
    return (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.remat, d.seq_len, d.global_batch,
            tuple(sorted(cfg.mesh.sizes().items())))
  held_out = {key(runners.entry_cfg(e)[0]) for e in suite.SUITE}
  for e in suite.CALIBRATION:
    assert key(runners.entry_cfg(e)[0]) not in held_out, e["name"]
  infer = {(e["batch"], e["prompt_len"], key(runners.entry_cfg(e)[0])) for e in suite.INFER}
  for e in suite.CALIBRATION_INFER:
    assert (e["batch"], e["prompt_len"], key(runners.entry_cfg(e)[0])) not in infer, e["name"]


def test_nodes_that_run_differently_do_not_share_a_profiled_fingerprint():
  """The profiled database keys on the fingerprint: a minor-moving layout change and one that keeps the minor
  dimension, or a plain XLA dot and a library dot, must not share an entry (the profiler times one per key)."""
  mod = """HloModule m
%strided (p0: f32[64,32]) -> f32[64,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  ROOT %c = f32[64,32]{0,1} copy(%p0)
}
%plain (p1: f32[64,32]) -> f32[64,32] {
  %p1 = f32[64,32]{1,0} parameter(0)
  ROOT %c1 = f32[64,32]{1,0} copy(%p1)
}
ENTRY %main (x: f32[64,32], w: f32[32,16]) -> f32[64,16] {
  %x = f32[64,32]{1,0} parameter(0)
  %w = f32[32,16]{1,0} parameter(1)
  %copy_fusion.1 = f32[64,32]{0,1} fusion(%x), kind=kLoop, calls=%strided
  %copy_fusion.2 = f32[64,32]{1,0} fusion(%x), kind=kLoop, calls=%plain
  ROOT %dot.1 = f32[64,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
  n = {x.name: x for x, _ in G.from_hlo_text(mod, 1).walk()}
  a, b = n["copy_fusion.1"], n["copy_fusion.2"]
  assert a.moves_minor and not b.moves_minor
  assert a.fingerprint != b.fingerprint
  assert a.fingerprint.replace(G.FP_MINOR, "") == b.fingerprint  # the minor tag is all that tells them apart
  assert n["dot.1"].fingerprint.endswith(G.FP_PLAIN)


def test_fusions_of_different_structure_do_not_share_a_profiled_fingerprint():
  """Same kind, output shape, flops and bytes, different fused computation (as a KV-cache update and a broadcast
  filling the cache): the structure tag keeps them apart, and the same structure keeps one key."""
  mod = """HloModule m
%sum (a: f32[8,64], b: f32[8,64]) -> f32[8,64] {
  %a = f32[8,64]{1,0} parameter(0)
  %b = f32[8,64]{1,0} parameter(1)
  ROOT %s = f32[8,64]{1,0} add(%a, %b)
}
%top (a2: f32[8,64], b2: f32[8,64]) -> f32[8,64] {
  %a2 = f32[8,64]{1,0} parameter(0)
  %b2 = f32[8,64]{1,0} parameter(1)
  ROOT %m = f32[8,64]{1,0} maximum(%a2, %b2)
}
%sum2 (a3: f32[8,64], b3: f32[8,64]) -> f32[8,64] {
  %a3 = f32[8,64]{1,0} parameter(0)
  %b3 = f32[8,64]{1,0} parameter(1)
  ROOT %s3 = f32[8,64]{1,0} add(%a3, %b3)
}
ENTRY %main (x: f32[8,64], y: f32[8,64]) -> f32[8,64] {
  %x = f32[8,64]{1,0} parameter(0)
  %y = f32[8,64]{1,0} parameter(1)
  %add_fusion.1 = f32[8,64]{1,0} fusion(%x, %y), kind=kLoop, calls=%sum
  %maximum_fusion.2 = f32[8,64]{1,0} fusion(%x, %y), kind=kLoop, calls=%top
  ROOT %add_fusion.3 = f32[8,64]{1,0} fusion(%add_fusion.1, %maximum_fusion.2), kind=kLoop, calls=%sum2
}
"""
  g = G.from_hlo_text(mod, 1)
  n = {x.name: x for x, _ in g.walk()}
  add, top, add2 = n["add_fusion.1"], n["maximum_fusion.2"], n["add_fusion.3"]
  untagged = lambda fp: fp[:fp.rindex("|s")]  # noqa: E731
  assert untagged(add.fingerprint) == untagged(top.fingerprint)  # without the tag the keys collide
  assert add.fingerprint != top.fingerprint
  assert add.fingerprint == add2.fingerprint
