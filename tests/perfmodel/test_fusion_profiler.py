"""The profiled backend's instruction path (perfmodel/cost/profiler.py): an instruction cut out of a
compiled program computes what it computed there, keeps its layouts, and every compute node is timed or reported;
profiling outside calibration writes the user's cache, never the committed database."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from perfmodel import hardware
from perfmodel.cost import profiler as fp, regime
from perfmodel.compositions import Calibration, Composition, Form
from perfmodel.cost import chain as costs
from perfmodel.cost import database
from perfmodel.graph import from_hlo as G
from perfmodel.graph import hlo_parse as hp
from perfmodel.graph.nodes import COMPUTE_KINDS

TRANSPOSE_COPY = """HloModule t

ENTRY %main (x: f32[64,32]) -> f32[64,32] {
  %x = f32[64,32]{1,0} parameter(0)
  ROOT %c = f32[64,32]{0,1} copy(%x)
}
"""

# A fusion instruction carried as such through StableHLO, its body relying on a layout-changing bitcast:
# XLA:CPU's compiler aborts the process on it (a CHECK failure), which is why timing happens in a child.
ABORTS_XLA = """HloModule standalone

%fused (p: s32[8,64]) -> s32[512,1] {
  %p = s32[8,64]{1,0} parameter(0)
  %b = s32[512,1]{0,1} bitcast(%p)
  ROOT %c = s32[512,1]{1,0} copy(%b)
}

ENTRY %main {
  %p0 = s32[8,64]{1,0} parameter(0)
  ROOT %target = s32[512,1]{1,0} fusion(%p0), kind=kLoop, calls=%fused
}
"""


def _fn(x, y):
  return jnp.tanh(x * y + 1.0).sum(axis=1)


def _compiled_text():
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  return jax.jit(_fn).lower(x, x).compile().as_text()


def test_standalone_fusion_computes_what_the_program_computed():
  text = _compiled_text()
  prog = fp.ProgramText(text)
  mod = hp.parse_module(text)
  root = mod.computations[mod.entry].root
  assert root.opcode == "fusion", root.opcode
  sub, types, out = prog.standalone(mod.entry, root.name)
  assert "ENTRY" in sub and len(types) == 2
  exe = fp.compile_standalone(sub, types, out)
  rng = np.random.default_rng(0)
  x, y = (rng.standard_normal((64, 128)).astype(np.float32) for _ in range(2))
  (got,) = fp.run_standalone(exe, [jax.device_put(x), jax.device_put(y)])
  np.testing.assert_allclose(np.asarray(got), np.asarray(_fn(x, y)), rtol=1e-5, atol=1e-5)


def test_standalone_copy_keeps_its_transposing_layout():
  prog = fp.ProgramText(TRANSPOSE_COPY)
  sub, types, out = prog.standalone("main", "c")
  exe = fp.compile_standalone(sub, types, out)
  # without the pinned entry layouts StableHLO would make this a plain memcpy into a row-major result
  assert "->f32[64,32]{0,1}" in exe.hlo_modules()[0].to_string().splitlines()[0]
  x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  (got,) = fp.run_standalone(exe, [jax.device_put(x)])
  np.testing.assert_array_equal(np.asarray(got), x)


TRANSPOSING_BITCAST = """HloModule b

%fused (p: s32[8,64]) -> s32[64,8] {
  %p = s32[8,64]{1,0} parameter(0)
  %b = s32[64,8]{0,1} bitcast(%p)
  ROOT %c = s32[64,8]{1,0} copy(%b)
}

ENTRY %main (x: s32[8,64]) -> s32[64,8] {
  %x = s32[8,64]{1,0} parameter(0)
  ROOT %f = s32[64,8]{1,0} fusion(%x), kind=kLoop, calls=%fused
}
"""


def test_layout_changing_bitcast_is_refused_with_a_reason():
  # a bitcast that only drops or adds dimensions of size 1 is the reshape it looks like, and is carried
  fp.ProgramText(ABORTS_XLA.replace("ENTRY %main {", "ENTRY %main (p0: s32[8,64]) -> s32[512,1] {")
                 ).standalone("main", "target")
  try:
    fp.ProgramText(TRANSPOSING_BITCAST).standalone("main", "f")
    raise AssertionError("a layout-changing bitcast inside a fusion must be refused")
  except ValueError as e:
    assert "bitcast" in str(e)


IN_PLACE = """HloModule d

%upd (b: f32[16,8], u: f32[1,8], i: s32[]) -> f32[16,8] {
  %b = f32[16,8]{1,0} parameter(0)
  %u = f32[1,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[16,8]{1,0} dynamic-update-slice(%b, %u, %i, %z)
}

ENTRY %main (b: f32[16,8], u: f32[1,8], i: s32[]) -> f32[16,8] {
  %b = f32[16,8]{1,0} parameter(0)
  %u = f32[1,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = f32[16,8]{1,0} fusion(%b, %u, %i), kind=kLoop, calls=%upd
}
"""


def test_in_place_update_is_timed_with_its_buffer_donated():
  prog = fp.ProgramText(IN_PLACE)
  assert prog.in_place_param("main", "f") == 0
  sub, types, out = prog.standalone("main", "f")
  exe = fp.compile_standalone(sub, types, out, alias=0)
  # donated: XLA aliases the buffer to the result instead of copying it first
  assert "input_output_alias" in exe.hlo_modules()[0].to_string().splitlines()[0]
  b = np.arange(128, dtype=np.float32).reshape(16, 8)
  u = np.full((1, 8), -1.0, np.float32)
  (got,) = fp.run_standalone(exe, [jax.device_put(b), jax.device_put(u), jax.device_put(np.int32(5))])
  want = b.copy()
  want[5] = -1.0
  np.testing.assert_array_equal(np.asarray(got), want)


def test_worker_reports_a_compiler_abort_and_carries_on():
  w = fp._Worker()
  try:
    r = w.run({"text": ABORTS_XLA, "types": ["s32[8,64]{1,0}"], "out": "s32[512,1]{1,0}"})
    assert r == {"error": "compiler aborted"}
    sub, types, out = fp.ProgramText(TRANSPOSE_COPY).standalone("main", "c")
    r = w.run({"text": sub, "types": types, "out": out})
    assert r.get("s", 0) > 0, r
  finally:
    w.close()


def test_profile_program_times_every_compute_node_or_says_why(tmp_path):
  text = _compiled_text()
  db = tmp_path / "db.json"
  res = fp.profile_program(text, 1, path=str(db))
  assert res["cached"] == 0
  g = G.from_hlo_text(text, 1)
  fps = {n.fingerprint for n, _ in g.walk() if n.kind in COMPUTE_KINDS}
  entries = json.loads(db.read_text())["entries"]
  assert res["timed"] + sum(res["skipped"].values()) == len(fps) and res["timed"] >= 1
  assert all(entries[f]["s"] > 0 for f in fps if f in entries)
  prof = database.Profiled(hardware.load("cpu"), str(db))
  priced = [prof.price(n) for n, _ in g.walk() if n.fingerprint in entries]
  assert priced and all(p.backend == "profiled:isolated-traced" for p in priced)
  # the same program again: nothing is timed, every timed node is found, the file is left as it was
  before = db.read_text()
  again = fp.profile_program(text, 1, path=str(db))
  assert again["timed"] == 0 and again["cached"] == res["timed"] and db.read_text() == before


def test_profiling_outside_calibration_writes_the_users_cache_and_prediction_reads_both(tmp_path, monkeypatch):
  monkeypatch.setenv(database.CACHE_ENV, str(tmp_path / "cache"))
  monkeypatch.setattr(database, "DB_DIR", str(tmp_path / "committed"))
  text = _compiled_text()
  res = fp.profile_program(text, 1, "cpu")
  cache = database.cache_path(database.db_name("cpu"))
  assert res["db"] == cache and res["timed"] >= 1 and not (tmp_path / "committed").exists()
  timed = json.loads(open(cache).read())["entries"]
  # a committed entry counts as timed (this boot, no calibration date), and a cache entry overrides it
  committed = database.committed_path(database.db_name("cpu"))
  fp_one = sorted(timed)[0]
  other = {"s": 9.0, "method": "isolated-traced", "boot": regime.boot_id(), "timed_at": "2030-01-01T00:00:00"}
  fp_new = "fusion|made-up"
  from perfmodel.calib import store
  store.write_json(committed, {"meta": {}, "entries": {fp_one: other, fp_new: other}})
  prof = database.Profiled(hardware.load("cpu"))
  assert prof.seconds(fp_one) == timed[fp_one]["s"] and prof.seconds(fp_new) == 9.0
  assert fp.profile_program(text, 1, "cpu")["timed"] == 0


def test_entries_of_another_boot_are_timed_again_unless_told_to_reuse_them(tmp_path):
  """A calibration fits its composition on this boot's node times and a prediction prices with them: entries of
  another boot (another machine, perhaps) are timed again; ``retime_other_boots=False`` reuses them."""
  text = _compiled_text()
  db = tmp_path / "db.json"
  res = fp.profile_program(text, 1, path=str(db))
  data = json.loads(db.read_text())
  assert {e["boot"] for e in data["entries"].values()} == {regime.boot_id()}
  for e in data["entries"].values():
    e["boot"], e["s"] = "another-vm", 1.0  # as if timed on another machine
  db.write_text(json.dumps(data))
  assert fp.profile_program(text, 1, path=str(db), retime_other_boots=False)["timed"] == 0  # reused as they are
  again = fp.profile_program(text, 1, path=str(db))
  assert again["timed"] == res["timed"] and again["cached"] == 0
  assert all(e["s"] < 1.0 and e["boot"] == regime.boot_id() for e in json.loads(db.read_text())["entries"].values())


def test_entries_timed_before_the_calibration_are_timed_again(tmp_path):
  """``stale_before`` (the profile's calibration date): an entry timed before it, or with no ``timed_at``, is
  timed again; one timed after it is reused."""
  text = _compiled_text()
  db = tmp_path / "db.json"
  res = fp.profile_program(text, 1, path=str(db))
  data = json.loads(db.read_text())
  stamps = {e["timed_at"] for e in data["entries"].values()}
  assert stamps and all(len(t) == 19 and t[10] == "T" for t in stamps)  # ISO, seconds
  assert fp.profile_program(text, 1, path=str(db), stale_before=min(stamps))["timed"] == 0  # not before: reused
  for e in data["entries"].values():
    e["timed_at"], e["s"] = "2000-01-01T00:00:00", 1.0  # as if timed long before the calibration
  db.write_text(json.dumps(data))
  assert fp.profile_program(text, 1, path=str(db))["timed"] == 0  # no calibration date given: reused
  again = fp.profile_program(text, 1, path=str(db), stale_before="2026-01-01T00:00:00")
  assert again["timed"] == res["timed"] and again["cached"] == 0
  assert all(e["s"] < 1.0 and e["timed_at"] > "2026" for e in json.loads(db.read_text())["entries"].values())
  for e in data["entries"].values():
    del e["timed_at"]  # an entry without a time counts as stale
  db.write_text(json.dumps(data))
  assert fp.profile_program(text, 1, path=str(db), stale_before="2026-01-01T00:00:00")["timed"] == res["timed"]


def test_profile_program_times_an_in_place_update(tmp_path):
  res = fp.profile_program(IN_PLACE, 1, path=str(tmp_path / "db.json"))
  assert res["timed"] == 1 and not res["skipped"], res
  assert 0 < res["seconds"]["f"] < 1e-3


def _comp(scale, loo=None):
  return Composition(forms={"train": Form(coef={"node_seconds": scale})}, loo_mape=loo)


def test_each_backend_composes_with_the_coefficients_fitted_for_its_prices():
  hw = hardware.load("cpu")
  hw = dataclasses.replace(hw, calibration=dataclasses.replace(
      hw.calibration, compositions={"learned": _comp(1.0), "profiled": _comp(2.0)}))
  assert costs.make_chain(hw, "profiled").composition() == _comp(2.0)
  assert costs.make_chain(hw, "learned").composition() == _comp(1.0)
  assert costs.make_chain(hw, "calibrated").composition() is None
  # learned prices what the profiler left out, before the curves
  assert costs.make_chain(hw, "profiled").names[:2] == ["profiled", "learned"]


def test_cli_predict_profile_nodes_prices_the_program_from_its_own_profiled_instructions(monkeypatch, capsys,
                                                                                       tmp_path):
  from perfmodel import cli
  monkeypatch.setenv(database.CACHE_ENV, str(tmp_path))
  cli.main(["predict", "--config", "experiments/configs/quickstart.py:runlocal=True", "--hardware", "cpu",
            "--mesh", "data=2", "--profile-nodes", "--backend", "profiled"])
  cap = capsys.readouterr()
  out = json.loads(cap.out.strip().splitlines()[-1])
  profiled = json.loads([ln for ln in cap.err.splitlines() if ln.startswith('{"profiled_nodes"')][-1])
  assert profiled["profiled_nodes"]["timed"] > 10
  by = out["breakdown"]["priced_by"]
  assert by.get("profiled:isolated-traced", 0) > 0 and out["step_time_s"] > 0
  # every compute node is priced by the profile or, where it was skipped, by the learned backend
  assert set(by) <= {"profiled:isolated-traced", "learned", "learned(out-of-range)", "none"} | {
      k for k in by if k.startswith("collective:")}, by


def test_auto_uses_the_backend_with_the_lower_calibration_leave_one_out():
  base = hardware.load("cpu")

  def with_loo(learned_loo, profiled_loo, profiled=True):
    comps = {"learned": _comp(1.0, learned_loo)}
    if profiled:
      comps["profiled"] = _comp(2.0, profiled_loo)
    return dataclasses.replace(base, calibration=dataclasses.replace(base.calibration, compositions=comps))
  lower_profiled, lower_learned = with_loo(16.6, 15.4), with_loo(10.6, 16.5)
  assert costs.resolve_backend(lower_profiled) == "profiled"
  assert costs.make_chain(lower_profiled).names[0] == "profiled"
  assert costs.resolve_backend(lower_learned) == "auto"
  assert costs.resolve_backend(with_loo(10.6, None, profiled=False)) == "auto"
  # an explicit backend is never overridden
  assert costs.resolve_backend(lower_profiled, "learned") == "learned"
  assert costs.make_chain(lower_learned).names[0] == "learned"  # the node samples ship with the profile
  assert costs.make_chain(lower_learned).composition() == _comp(1.0, 10.6)
  assert costs.make_chain(lower_profiled).composition() == _comp(2.0, 15.4)


def test_each_instruction_is_timed_in_two_passes_and_the_lower_is_kept(tmp_path, monkeypatch):
  """A preemption that spans one instruction's timing window inflates that window only: the passes run one after
  the other over the whole program, and the entry is the lowest (each pass is kept in ``passes_s``)."""
  calls = []

  class Disturbed:  # the first pass of the first instruction is preempted (10x), everything else is 1 us
    def run(self, job):
      calls.append(job["text"])
      return {"s": 10e-6 if len(calls) == 1 else 1e-6}

    def close(self):
      pass
  monkeypatch.setattr(fp, "_Worker", Disturbed)
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  text = jax.jit(lambda a, b: jnp.tanh(a @ b.T) @ b).lower(x, x).compile().as_text()  # a few instructions
  db = tmp_path / "db.json"
  res = fp.profile_program(text, 1, path=str(db))
  n = res["timed"]
  assert n >= 2 and len(calls) == 2 * n  # every instruction once per pass
  assert calls[:n] == calls[n:]  # pass after pass over the whole program, not twice in a row
  entries = json.loads(db.read_text())["entries"]
  assert all(e["s"] == 1e-6 and len(e["passes_s"]) == 2 for e in entries.values())
  assert sorted(max(e["passes_s"]) for e in entries.values())[-1] == 10e-6  # the disturbed pass is on record
  calls.clear()
  assert fp.profile_program(text, 1, path=str(tmp_path / "one.json"), passes=1)["timed"] == n and len(calls) == n


def test_entries_older_than_the_last_profiled_calibration_are_stale():
  hw = hardware.load("cpu")
  at = lambda **kw: dataclasses.replace(hw, calibration=Calibration(**kw))  # noqa: E731
  assert fp.stale_before(at()) is None
  assert fp.stale_before(at(date="2026-12-02T20:15:15")) == "2026-12-02T20:15:15"
  assert fp.stale_before(at(date="2026-12-02T20:15:15", profiled_date="2026-12-03T02:40:00")) == "2026-12-03T02:40:00"


def test_profile_program_times_the_nodes_of_every_branch_of_a_conditional(tmp_path):
  def fn(p, x):
    return jax.lax.cond(p, lambda v: jnp.tanh(v @ v).sum(), lambda v: jnp.exp(v * 3.0).max(), x)
  x = jax.ShapeDtypeStruct((32, 32), jnp.float32)
  text = jax.jit(fn).lower(jax.ShapeDtypeStruct((), jnp.bool_), x).compile().as_text()
  g = G.from_hlo_text(text, 1)
  conds = [n for r in g.regions.values() for n in r.nodes if n.branches]
  assert conds and len(conds[0].branches) == 2
  in_branches = {n.fingerprint for b in conds[0].branches for n in g.regions[b].nodes if n.kind in COMPUTE_KINDS}
  first_only = {n.fingerprint for n, _ in g.walk() if n.kind in COMPUTE_KINDS}
  assert not in_branches <= first_only  # the walk of an unresolved conditional misses a branch
  res = fp.profile_program(text, 1, path=str(tmp_path / "db.json"), passes=1)
  entries = json.loads((tmp_path / "db.json").read_text())["entries"]
  assert in_branches and all(f in entries for f in in_branches), res["skipped"]
