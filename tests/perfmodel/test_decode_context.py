"""Decode nodes are priced by sampler programs (perfmodel/cost/learned.py): a node inside a sampler's decode loop
is flagged (graph.nodes.mark_decode), draws its neighbours from the calibration's sampler programs only (class
``@decode``, own k and beta), and falls back to all samples of its class where no sampler sample has it."""
import jax
import jax.numpy as jnp

from perfmodel import hardware
from perfmodel.calib import refit
from perfmodel.cost import learned
from perfmodel.graph import from_hlo, nodes as G


def _loop_graph():
  def f(x, w):
    y = jnp.tanh(x) @ w  # outside the loop
    return jax.lax.fori_loop(0, 7, lambda i, y: jnp.tanh(y @ w) * 2.0, y)
  x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  g = from_hlo.from_hlo_text(jax.jit(f).lower(x, w).compile().as_text(), 1)
  loop = next(n for n in g.regions[g.entry].nodes if n.kind == "loop")
  return g, loop


def test_mark_decode_flags_the_loop_body_and_nothing_else():
  g, loop = _loop_graph()
  assert not any(n.decode for n, _ in g.walk())
  G.mark_decode(g, loop.body)
  inside = [n for n, _ in g.walk(loop.body)]
  assert inside and all(n.decode for n in inside)
  assert not any(n.decode for n in g.regions[g.entry].nodes)
  compute = [n for n in inside if n.kind in ("dot", "fusion")]
  assert compute and all(learned.node_class(n) == learned.base_class(n) + learned.DECODE for n in compute)
  G.mark_decode(g, None)  # no decode loop: nothing to do


def _sample(node, t, prog, sampler):
  return {"prog": prog, "cls": learned.base_class(node) + (learned.DECODE if sampler else ""),
          "f": learned.features(node), "t": t, "phys": 1e-6, "P": 0.0, "name": node.name, "fp": node.fingerprint}


def test_decode_nodes_take_sampler_neighbours_and_others_take_all():
  g, loop = _loop_graph()
  G.mark_decode(g, loop.body)
  dec = next(n for n, _ in g.walk(loop.body) if n.kind == "fusion")
  hw = hardware.load("cpu")
  # the same node measured in a training program (4 us) and in a sampler program (1 us), physical estimate 1 us
  samples = [_sample(dec, 4e-6, "train_prog", False), _sample(dec, 1e-6, "sampler_prog", True)]
  m = learned.Learned(hw, samples=samples, k=1, beta=0.0, k_decode=1, beta_decode=0.0)
  ratio = m.phys.price(dec).seconds / 1e-6
  assert abs(m.price(dec).seconds - 1e-6 * ratio) < 1e-12 * ratio  # only the sampler's sample
  # a training query of the same class sees both samples (k=2: their weighted geometric mean, between them)
  m2 = learned.Learned(hw, samples=samples, k=2, beta=0.0, k_decode=1, beta_decode=0.0)
  undecoded = G.Node(**{**dec.__dict__, "decode": False})
  r = m2.phys.price(undecoded).seconds / 1e-6
  assert 1e-6 * r < m2.price(undecoded).seconds < 4e-6 * r
  # no sampler sample of the class: the decode node falls back to the training samples
  m3 = learned.Learned(hw, samples=samples[:1], k=1, beta=0.0)
  assert abs(m3.price(dec).seconds - 4e-6 * ratio) < 1e-12 * ratio


def test_refit_rederives_classes_and_keeps_the_decode_label_of_a_sampler_programs_samples():
  g, loop = _loop_graph()
  n = next(n for n, _ in g.walk() if n.kind == "fusion")
  samples = [dict(_sample(n, 1e-6, "dec", False), cls="stale"), dict(_sample(n, 1e-6, "train", False), cls="stale")]
  out, dropped = refit.refresh_samples(samples, {"dec": g, "train": g}, {"dec"})
  assert dropped == 0 and out[0]["cls"] == learned.base_class(n) + learned.DECODE
  assert out[1]["cls"] == learned.base_class(n)
