"""The hybrid backend (perfmodel/hybrid.py): a node's profiled time scaled by the in-program/alone ratio of its
nearest calibration samples; selected by `auto` only when its calibration leave-one-out is the lowest."""
import dataclasses
import json

import jax
import jax.numpy as jnp

from perfmodel import costs, graph as G, hardware, hybrid, learned, predict


def _nodes():
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  w = jax.ShapeDtypeStruct((128, 96), jnp.float32)
  text = jax.jit(lambda x, w: (jnp.tanh(x) @ w).T * 2.0).lower(x, w).compile().as_text()  # fusion, dot, fusion
  return [n for n, _ in G.from_hlo_text(text, 1).walk() if n.kind in ("dot", "fusion")]


def _db(tmp_path, entries):
  path = tmp_path / "db.json"
  path.write_text(json.dumps({"meta": {}, "entries": entries}))
  return costs.Profiled(hardware.load("cpu"), str(path))


def _sample(node, fp, t, prog="p"):
  return {"prog": prog, "cls": learned.node_class(node), "f": learned.features(node), "t": t, "phys": 1e-4,
          "P": 0.0, "name": node.name, "fp": fp}


def test_price_is_the_profiled_time_times_the_neighbours_in_program_ratio(tmp_path):
  node = _nodes()[0]
  # two calibration samples of the node's class ran 3x and 3x their time alone; the node itself was profiled
  db = _db(tmp_path, {node.fingerprint: {"s": 2e-5, "method": "isolated-traced"},
                      "a": {"s": 1e-4}, "b": {"s": 4e-4}})
  h = hybrid.Hybrid(hardware.load("cpu"), [_sample(node, "a", 3e-4), _sample(node, "b", 1.2e-3)], db, k=2)
  p = h.price(node)
  assert p.backend == "hybrid" and abs(p.seconds - 6e-5) < 1e-12
  # a sample the database lacks takes no part; a node the database lacks is left to the next backend
  h2 = hybrid.Hybrid(hardware.load("cpu"), [_sample(node, "a", 3e-4), _sample(node, "zz", 9.0)], db, k=2)
  assert abs(h2.price(node).seconds - 6e-5) < 1e-12
  other = dataclasses.replace(node, fingerprint="not-profiled")
  assert h.price(other) is None


def test_a_class_without_samples_is_left_to_the_learned_backend(tmp_path):
  dot = next(n for n in _nodes() if n.kind == "dot")
  fusion = next(n for n in _nodes() if n.kind == "fusion")
  assert learned.node_class(dot) != learned.node_class(fusion)
  db = _db(tmp_path, {dot.fingerprint: {"s": 1e-5}, "a": {"s": 1e-4}})
  h = hybrid.Hybrid(hardware.load("cpu"), [_sample(fusion, "a", 2e-4)], db)
  assert h.price(dot) is None


def test_auto_picks_the_fitted_backend_with_the_lowest_calibration_leave_one_out():
  base = hardware.load("cpu")

  def with_loo(**loo):
    cal = {k: v for k, v in base.calibration.items() if not k.startswith(("composition", "calibration_loo"))}
    for name, value in loo.items():
      comp, key = costs.FITTED[name]
      cal.update({comp: {"train": {"a": {"learned": 1.0, "profiled": 2.0, "hybrid": 3.0}[name]}}, key: value})
    return dataclasses.replace(base, calibration=cal)
  hw = with_loo(learned=14.7, profiled=17.6, hybrid=12.7)
  assert costs.resolve_backend(hw) == "hybrid"
  chain = costs.make_chain(hw)
  assert chain.names[:2] == ["hybrid", "learned"]
  assert predict.composition_for(hw, chain) == {"train": {"a": 3.0}}
  assert costs.resolve_backend(with_loo(learned=12.0, profiled=17.6, hybrid=12.7)) == "auto"
  assert costs.resolve_backend(with_loo(learned=14.7, profiled=11.0, hybrid=12.7)) == "profiled"
  assert costs.resolve_backend(with_loo(learned=12.7, hybrid=12.7)) == "auto"  # a tie keeps learned
  assert costs.resolve_backend(hw, "learned") == "learned"
  assert "hybrid" in costs.NEEDS_PROFILED_PROGRAM  # predict / validate profile the program first


def test_cli_predict_hybrid_profiles_the_program_then_prices_it_in_context(monkeypatch, capsys, tmp_path):
  import shutil

  from perfmodel import cli
  shutil.copy(costs.db_path("cpu"), tmp_path)  # the calibration samples' alone times; the shipped copy stays
  monkeypatch.setattr(costs, "DB_DIR", str(tmp_path))
  cli.main(["predict", "--config", "experiments/configs/quickstart.py:runlocal=True", "--hardware", "cpu",
            "--mesh", "data=2", "--backend", "hybrid"])
  cap = capsys.readouterr()
  out = json.loads(cap.out.strip().splitlines()[-1])
  profiled = json.loads([ln for ln in cap.err.splitlines() if ln.startswith('{"profiled_nodes"')][-1])
  assert profiled["profiled_nodes"]["timed"] + profiled["profiled_nodes"].get("cached", 0) > 10, profiled
  by = out["breakdown"]["priced_by"]
  assert by.get("hybrid", 0) > 10 and out["step_time_s"] > 0, by
  assert set(by) <= {"hybrid", "learned", "learned(out-of-range)", "none"} | {
      k for k in by if k.startswith("collective:")}, by
