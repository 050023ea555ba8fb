"""The committed published validation can be re-run and trusted: `validate --published --reprice` reproduces the
committed JSON from the committed programs, the record is that JSON alone, and a program compiled from
another config or other code is flagged stale."""
import json
import os
import re

import pytest

from perfmodel.calib import published as P
from perfmodel.calib import published_mapping as M
from perfmodel.calib import published_programs as PP
from perfmodel.calib import published_validate as PV


@pytest.fixture(scope="module")
def committed():
  with open(PV.JSON_PATH) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def repriced():
  return PV.run(reprice=True, log=lambda *_: None)


def test_freshness_names_what_changed():
  r = next(x for x in P.load() if x.id == "maxtext_v5e_16b_1x256")
  m = M.row_config(r)
  prov = {"overrides": m.overrides, "topology": m.topology, "framework": m.framework, **PP.code_version()}
  assert PP.freshness(r, m, prov) == []
  (why,) = PP.freshness(r, m, dict(prov, framework=None))  # priced as another framework
  assert why.startswith("mapping:") and "'maxtext:none'" in why
  other = dict(prov, overrides=[o.replace("remat=full", "remat=minimal") for o in m.overrides])
  (why,) = PP.freshness(r, m, other)
  assert why.startswith("mapping:") and "model.remat: minimal -> full" in why
  (why,) = PP.freshness(r, m, dict(prov, sources="0" * 16))
  assert why.startswith("code:") and "0" * 16 in why
  (why,) = PP.freshness(r, m, dict(prov, config_fingerprint="f" * 20))  # a stored fingerprint is what counts
  assert why.startswith("mapping:")


MOE_CSV = os.path.join(P.DATA_DIR, "published_moe_training.csv")


def test_committed_programs_are_of_included_rows():
  rows = {r.id: r for r in P.included(P.load(), precision=None) + P.included(P.load(MOE_CSV), precision=None)}
  files = [f for f in os.listdir(PP.DIR) if f.endswith(".json.xz")]
  assert files
  for f in files:
    row_id = f[:-len(".json.xz")]
    assert row_id in rows, f"{f}: no included row of that id"
    _, prov = PP.load(row_id)
    assert prov["row"] == row_id and prov["hardware"] == rows[row_id].hardware and prov["overrides"]


def _mapping_only(reasons):
  """Stale reasons that change what a row means (its mapping). 'code:' reasons (the builder's sources moved on
  since the programs were compiled) are reported by validate but do not change a repriced number, so any
  commit to framework/ or parallelism/ would otherwise fail this test until every program is recompiled."""
  return [r for r in reasons if not r.startswith("code:")]


def test_reprice_reproduces_the_committed_json(committed, repriced):
  # the same rows and options; how the programs were obtained (--save-programs / --reprice) aside
  how = re.compile(r" --(reprice|save-programs|compile-budget \S+)")
  assert how.sub("", committed["command"]) == how.sub("", repriced["command"])
  got = {e["id"]: e for e in repriced["rows"]}
  assert set(got) == {e["id"] for e in committed["rows"]}
  for e in committed["rows"]:
    g = got[e["id"]]
    assert g.get("error") == e.get("error"), e["id"]
    if "predicted_s" in e:
      assert g["predicted_s"] == pytest.approx(e["predicted_s"], rel=1e-9), e["id"]
      assert g["fits_in_memory"] == e["fits_in_memory"], e["id"]
      assert _mapping_only(g["stale_reasons"]) == _mapping_only(e["stale_reasons"]), e["id"]
      assert [f["flag"] for f in g["flags"]] == [f["flag"] for f in e["flags"]], e["id"]
  for k in ("n_priced", "n_failed", "n_not_compiled", "fits", "flagged_mfu", "not_compiled"):
    assert repriced[k] == committed[k], k
  for group, s in committed["scores"].items():
    for who in ("model", "baseline"):
      for stat in ("mape_pct", "mean_signed_pct", "tau_global", "tau_tables"):
        assert repriced["scores"][group][who][stat] == pytest.approx(s[who][stat], rel=1e-9, abs=1e-12), (
            group, who, stat)


def test_the_record_is_the_json_alone(committed, tmp_path):
  """``--record`` writes the JSON, with what ran it, when and where; it appends to no log."""
  assert committed["wall_s"] > 0 and committed["run_at"] and committed["command"] and committed["host"]
  path = tmp_path / "data" / "published_validation.json"
  PV.write_record(committed, json_path=str(path))
  assert json.loads(path.read_text()) == committed
  assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["published_validation.json"]


def test_every_included_row_is_accounted_for(committed):
  rows = P.included(P.load(), precision=None)
  assert {e["id"] for e in committed["rows"]} == {r.id for r in rows}
  for e in committed["rows"]:  # priced, or a named reason: never silently dropped
    assert "predicted_s" in e or re.match(r"(not compiled: \w+ path missing|no committed program|mapping:)",
                                          e["error"]), e
    assert e["baseline_s"] > 0


def test_record_needs_a_reproducible_run():
  with pytest.raises(SystemExit, match="--save-programs"):
    PV.run(record=True, log=lambda *_: None)


def test_strict_refuses_a_stale_program(monkeypatch):
  now = PP.code_version()
  monkeypatch.setattr(PP, "code_version", lambda: dict(now, sources="0" * 16))  # every program is now stale
  out = PV.run(reprice=True, strict=True, ids=["maxtext_v5e_16b_1x256"], log=lambda *_: None)
  (row,) = out["rows"]
  assert row["error"].startswith("stale program: code:") and out["n_priced"] == 0


def test_moe_reprice_reproduces_its_committed_json():
  """The mixture-of-experts rows' record (published_moe_validation.json) from their committed programs: every
  priced row's prediction and every score; a row that did not compile has no program and stays unpriced."""
  with open(PV.record_path(MOE_CSV)) as f:
    committed = json.load(f)
  repriced = PV.run(csv=MOE_CSV, reprice=True, log=lambda *_: None)
  got = {e["id"]: e for e in repriced["rows"]}
  assert set(got) == {e["id"] for e in committed["rows"]}
  for e in committed["rows"]:
    if "predicted_s" in e:
      assert got[e["id"]]["predicted_s"] == pytest.approx(e["predicted_s"], rel=1e-9), e["id"]
      assert got[e["id"]]["fits_in_memory"] == e["fits_in_memory"], e["id"]
    else:
      assert "predicted_s" not in got[e["id"]] and e["error"], e["id"]
  for k in ("n_priced", "n_failed", "fits"):
    assert repriced[k] == committed[k], k
  for group, sc in committed["scores"].items():
    for who in ("model", "baseline"):
      for stat in ("mape_pct", "tau_global"):
        assert repriced["scores"][group][who][stat] == pytest.approx(sc[who][stat], rel=1e-9, abs=1e-12), (
            group, who, stat)
