"""The hybrid backend (perfmodel/cost/hybrid.py): a node's profiled time scaled by the in-program/alone ratio of
its nearest calibration samples; selected by `auto` only when its calibration leave-one-out is the lowest."""
import dataclasses
import json

import jax
import jax.numpy as jnp

from perfmodel import hardware
from perfmodel.calib import nodes, refit
from perfmodel.compositions import Composition, Form
from perfmodel.cost import chain as costs
from perfmodel.cost import database, hybrid, learned
from perfmodel.cost.physical import Calibrated
from perfmodel.graph import from_hlo as G
from perfmodel.graph.nodes import ExecGraph, Region


def _nodes():
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  w = jax.ShapeDtypeStruct((128, 96), jnp.float32)
  text = jax.jit(lambda x, w: (jnp.tanh(x) @ w).T * 2.0).lower(x, w).compile().as_text()  # fusion, dot, fusion
  return [n for n, _ in G.from_hlo_text(text, 1).walk() if n.kind in ("dot", "fusion")]


def _db(tmp_path, entries):
  path = tmp_path / "db.json"
  path.write_text(json.dumps({"meta": {}, "entries": entries}))
  return database.Profiled(hardware.load("cpu"), str(path))


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


def test_a_decode_node_takes_its_ratio_from_the_sampler_programs_samples(tmp_path):
  node = _nodes()[0]
  db = _db(tmp_path, {node.fingerprint: {"s": 2e-5}, "a": {"s": 1e-4}, "b": {"s": 1e-4}})
  train = _sample(node, "a", 1e-4, prog="train")  # ratio 1 in a training step
  dec = {**_sample(node, "b", 3e-4, prog="sampler"), "cls": learned.node_class(node) + learned.DECODE}  # 3 in a loop
  h = hybrid.Hybrid(hardware.load("cpu"), [train, dec], db, k=1, k_decode=1)
  in_loop = dataclasses.replace(node, decode=True)
  assert abs(h.price(in_loop).seconds - 6e-5) < 1e-12  # the sampler program's ratio, though both are as near
  assert abs(hybrid.Hybrid(hardware.load("cpu"), [train, dec], db, k=2).price(node).seconds - 2e-5 * 3 ** 0.5) < 1e-12
  # without a sampler sample of its class a decode node falls back to all samples of the class
  assert abs(hybrid.Hybrid(hardware.load("cpu"), [train], db, k=1).price(in_loop).seconds - 2e-5) < 1e-12


def test_the_ratio_uses_the_statistic_calibration_chose(tmp_path):
  node = _nodes()[0]
  db = _db(tmp_path, {node.fingerprint: {"s": 2e-5}, "a": {"s": 1e-4}})
  s = {**_sample(node, "a", 1e-4), "t50": 2e-4, "tm": 4e-4}  # p25 / median / mean of the in-program times
  assert learned.stats_of([s]) == ("t", "t50", "tm")
  assert learned.stats_of([s, _sample(node, "a", 1e-4)]) == ("t",)  # a sample without them: p25 only
  for stat, ratio in (("t", 1.0), ("t50", 2.0), ("tm", 4.0)):
    assert abs(hybrid.Hybrid(hardware.load("cpu"), [s], db, k=1, stat=stat).price(node).seconds - 2e-5 * ratio) < 1e-12
  # decode nodes have their own statistic
  h = hybrid.Hybrid(hardware.load("cpu"), [{**s, "cls": s["cls"] + learned.DECODE}], db, k=1, stat="t",
                    stat_decode="tm")
  assert abs(h.price(dataclasses.replace(node, decode=True)).seconds - 8e-5) < 1e-12
  # samples without the chosen statistic are priced at their p25
  plain = _sample(node, "a", 1e-4)
  assert abs(hybrid.Hybrid(hardware.load("cpu"), [plain], db, k=1, stat="tm").price(node).seconds - 2e-5) < 1e-12
  assert learned.Learned(hardware.load("cpu"), samples=[plain], stat="tm", stat_decode="t50").stat_decode == "t"
  lrn = learned.Learned(hardware.load("cpu"), samples=[s], k=1, beta=0.0, stat="t50")
  assert abs(lrn.price(node).seconds / learned.Learned(hardware.load("cpu"), samples=[s], k=1, beta=0.0,
                                                       stat="t").price(node).seconds - 2.0) < 1e-9


def test_a_calibration_sample_carries_p25_median_and_mean_of_its_in_program_times():
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  w = jax.ShapeDtypeStruct((128, 96), jnp.float32)
  g = G.from_hlo_text(jax.jit(lambda x, w: (jnp.tanh(x) @ w).T * 2.0).lower(x, w).compile().as_text(), 1)
  node = next(n for n, _ in g.walk() if n.kind == "dot")
  times = [1e-4, 2e-4, 3e-4, 4e-4, 1e-2]  # one preempted occurrence: the mean pays it, p25 and the median do not
  (s,) = nodes.node_samples(g, {node.name: times}, "p", Calibrated(hardware.load("cpu")))
  assert (s["t"], s["t50"]) == (2e-4, 3e-4) and abs(s["tm"] - sum(times) / 5) < 1e-15


def test_a_class_without_samples_is_left_to_the_learned_backend(tmp_path):
  dot = next(n for n in _nodes() if n.kind == "dot")
  fusion = next(n for n in _nodes() if n.kind == "fusion")
  assert learned.node_class(dot) != learned.node_class(fusion)
  db = _db(tmp_path, {dot.fingerprint: {"s": 1e-5}, "a": {"s": 1e-4}})
  h = hybrid.Hybrid(hardware.load("cpu"), [_sample(fusion, "a", 2e-4)], db)
  assert h.price(dot) is None


def test_auto_picks_the_fitted_backend_with_the_lowest_calibration_leave_one_out():
  base = hardware.load("cpu")

  scale = {"learned": 1.0, "profiled": 2.0, "hybrid": 3.0}

  def with_loo(**loo):
    comps = {name: Composition(forms={"train": Form(coef={"node_seconds": scale[name]})}, loo_mape=value)
             for name, value in loo.items()}
    return dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, compositions=comps))
  hw = with_loo(learned=14.7, profiled=17.6, hybrid=12.7)
  assert costs.resolve_backend(hw) == "hybrid"
  chain = costs.make_chain(hw)
  assert chain.names[:2] == ["hybrid", "learned"]
  assert chain.composition().forms["train"].coef["node_seconds"] == 3.0
  assert costs.resolve_backend(with_loo(learned=12.0, profiled=17.6, hybrid=12.7)) == "auto"
  assert costs.resolve_backend(with_loo(learned=14.7, profiled=11.0, hybrid=12.7)) == "profiled"
  assert costs.resolve_backend(with_loo(learned=12.7, hybrid=12.7)) == "auto"  # a tie keeps learned
  assert costs.resolve_backend(hw, "learned") == "learned"
  assert "hybrid" in costs.NEEDS_PROFILED_PROGRAM  # predict / validate profile the program first


def test_cli_predict_hybrid_profiles_the_program_then_prices_it_in_context(monkeypatch, capsys, tmp_path):
  from perfmodel import cli
  monkeypatch.setenv(database.CACHE_ENV, str(tmp_path))  # profiling writes the user's cache, never the shipped db
  committed = database.committed_path(database.db_name("cpu"))
  before = open(committed).read()
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
  assert open(committed).read() == before


def test_with_a_program_bytes_weight_the_ratio_comes_from_programs_that_move_as_much(tmp_path):
  node = _nodes()[0]
  db = _db(tmp_path, {node.fingerprint: {"s": 2e-5}, "a": {"s": 1e-4}, "b": {"s": 1e-4}})
  # the same node shape in a 40 MB program ran 3x its alone time, in a 4 MB program 1.2x
  big = {**_sample(node, "a", 3e-4, prog="big"), "P": 40e6}
  small = {**_sample(node, "b", 1.2e-4, prog="small"), "P": 4e6}
  cpu = hardware.load("cpu")
  query = dataclasses.replace(node, program_bytes=5e6)
  assert abs(hybrid.Hybrid(cpu, [big, small], db, k=1, wp=1.0).price(query).seconds - 2e-5 * 1.2) < 1e-12
  assert abs(hybrid.Hybrid(cpu, [big, small], db, k=1, wp=1.0).price(
      dataclasses.replace(node, program_bytes=30e6)).seconds - 2e-5 * 3.0) < 1e-12
  # weight 0 (a profile fitted before it): the shape alone, both samples as near: their geometric mean
  both = 2e-5 * (3.0 * 1.2) ** 0.5
  assert abs(hybrid.Hybrid(cpu, [big, small], db, k=2, wp=0.0).price(query).seconds - both) < 1e-12
  assert hybrid.Hybrid(cpu, [big, small], db, k=1).wp == cpu.calibration.neighbours["hybrid"]["train"].wp
  # a query or a sample without program bytes has no context: that dimension adds nothing
  unknown = dataclasses.replace(node, program_bytes=0.0)
  assert abs(hybrid.Hybrid(cpu, [big, small], db, k=2, wp=1.0).price(unknown).seconds - both) < 1e-12
  assert list(hybrid.context_distance(hybrid.np.log(hybrid.np.array([4e6, hybrid.np.nan])), 4e6)) == [0.0, 0.0]
  # decode nodes have their own weight
  dec = [{**s, "cls": s["cls"] + learned.DECODE} for s in (big, small)]
  h = hybrid.Hybrid(cpu, dec, db, k=1, k_decode=1, wp=0.0, wp_decode=2.0)
  assert abs(h.price(dataclasses.replace(query, decode=True)).seconds - 2e-5 * 1.2) < 1e-12


def test_fit_hybrid_chooses_the_program_bytes_weight_by_leave_one_program_out(tmp_path):
  """Three one-node programs of one shape whose in-program/alone ratio follows the bytes they move: a program
  left out is priced right only when its ratio comes from the program nearest in bytes, so the fit must pick a
  weight above 0, with k and the statistic."""
  node = _nodes()[0]
  entries, samples, programs = {node.fingerprint: {"s": 1e-4}}, [], []
  cpu = hardware.load("cpu")
  for i, (pb, ratio) in enumerate(((1e6, 1.0), (1.2e6, 1.05), (50e6, 3.0), (60e6, 3.1))):
    fp = f"s{i}"
    entries[fp] = {"s": 1e-4}
    samples.append({**_sample(node, fp, 1e-4 * ratio, prog=f"p{i}"), "P": pb})
    n = dataclasses.replace(node, program_bytes=pb)
    g = ExecGraph(regions={"main": Region(name="main", nodes=[n])}, entry="main", n_devices=1)
    cap = type("Cap", (), {"n_devices": 1, "memory": {}})()
    programs.append((f"p{i}", {"measured_s": 1e-4 * ratio, "noise_pct": 0.0}, g, cap, None, False))
  db = _db(tmp_path, entries)
  res = refit.fit_hybrid(cpu, programs, samples, db, log=lambda *a: None, wp_grid=(0.0, 1.0), train_wp=(0.0, 1.0))
  assert res["neighbours"]["train"].wp == 1.0, res["by_choice"]
  assert set(res["neighbours"]) == {"train", "decode"} and res["composition"].loo_mape is not None
  assert res["by_choice"]["2 t wp1"] < res["by_choice"]["2 t"]
  # by default the training rows keep weight 0 (refit.WP_TRAIN), whatever their leave-one-out would choose
  assert refit.fit_hybrid(cpu, programs, samples, db, log=lambda *a: None,
                          wp_grid=(0.0, 1.0))["neighbours"]["train"].wp == 0.0
