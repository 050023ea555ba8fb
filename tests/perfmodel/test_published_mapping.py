"""perfmodel.calib.published_mapping: what each published row ran (facts with sources) and its config keys.

The facts are checked against what the rows and their frameworks state (cited in the module); the translation is
checked for its failure mode: a feature whose key this checkout lacks is never compiled without it.
"""
import dataclasses

import pytest

from framework.config import ConfigError
from perfmodel.calib import published as P
from perfmodel.calib import published_mapping as M


@pytest.fixture(scope="module")
def rows():
  return {r.id: r for r in P.load()}


def _values(f):
  return {k: v.value for k, v in f.items()}


def test_megatron_core_rows_ran_the_distributed_optimizer_with_fp32_master_weights(rows):
  f = M.row_features(rows["megatron_h100_177B"])  # TP8 PP6 dp48; notes list the overlap flags
  v = _values(f)
  assert (v["optimizer_sharding"], v["master_weights"], v["schedule"], v["virtual_stages"]) == ("data", "f32",
                                                                                                 "1f1b", 1)
  assert set(v["overlap"]) == {"grad_reduce", "param_gather", "tp_comm"}
  assert "--use-distributed-optimizer" in f["optimizer_sharding"].source and f["overlap"].source.startswith("CSV")


def test_nemo_rows_interleave_with_their_vpp_and_run_ring_context_parallelism(rows):
  v = _values(M.row_features(rows["dgxc_nemo_llama31_405b_bf16_576"]))  # TP8 PP9 CP2 VP7 dp4
  # ring attention is not built inside pipeline stages: declared, and K/V all-gathered instead
  assert (v["schedule"], v["virtual_stages"], v["context_parallel"]) == ("interleaved", 7, "ring_in_pipeline")
  assert (v["optimizer_sharding"], v["master_weights"], v["recompute"]) == ("data", "f32", "minimal_flash")
  v = _values(M.row_features(rows["dgxc_nemo_llama31_8b_bf16_8"]))
  assert v["context_parallel"] == ("ring" if rows["dgxc_nemo_llama31_8b_bf16_8"].sequence > 1 else "none")


def test_every_row_feature_has_a_config_path():
  # every feature the rows ran maps to keys this checkout's Config has: no row is 'not compiled: ... path missing'
  missing = {r.id: m.error for r in P.load() for m in [M.row_config(r)] if "path missing" in m.error}
  assert not missing, missing


def test_the_features_reach_the_built_config(rows):
  m = M.row_config(rows["megatron_h100_177B"])  # distributed optimizer, fp32 masters, 1F1B, all three overlaps
  cfg = M.build_config(m.overrides, rows["megatron_h100_177B"].n_chips)
  assert (cfg.optim.shard_optimizer_state, cfg.optim.master_weights, cfg.model.param_dtype) == (True, True, "bfloat16")
  assert (cfg.mesh.schedule, cfg.mesh.virtual_stages) == ("1f1b", 1)
  assert m.framework == "megatron:grad_reduce,param_gather,tp_comm"
  r = rows["dgxc_nemo_llama31_405b_bf16_576"]
  cfg = M.build_config(M.row_config(r).overrides, r.n_chips)
  assert (cfg.mesh.schedule, cfg.mesh.virtual_stages, cfg.model.attention) == ("1f1b", 7, "cudnn")
  mx = dataclasses.replace(rows["maxtext_v5e_16b_1x256"], pipeline=4, fsdp=64)  # MaxText pipelines are circular
  f = M.row_features(mx)
  assert M.features_to_overrides(f)["mesh.schedule"] == "gpipe" and f["virtual_stages"].value == 2
  r = rows["dgxc_paxml_gpt_5b_fp8_16"]
  assert M.build_config(M.row_config(r).overrides, r.n_chips).model.matmul_precision == "fp8"
  assert M.row_config(rows["sc21_a100_145.6B"]).framework == "megatron:none"  # 2021 Megatron: no overlap options


def test_fsdp_frameworks_shard_the_optimizer_with_the_parameters(rows):
  for rid in ("maxtext_v5e_16b_2x256", "llmfoundry_mpt70b_h100_bf16_s2048_n64", "torchtitan_llama31_8b_8gpu_eager",
              "dgxc_paxml_gpt_5b_bf16_32"):
    v = _values(M.row_features(rows[rid]))
    assert (v["optimizer_sharding"], v["master_weights"], v["schedule"]) == ("fsdp", "params", "none"), rid
    assert M.features_to_overrides(M.row_features(rows[rid])).get("model.param_dtype") == "float32"


def test_interleaved_without_a_count_uses_the_rule(rows):
  # SC21 notes: interleaved for PP > 1, chunks not tabulated: 2, or the smallest count dividing the layers per stage
  assert _values(M.row_features(rows["sc21_a100_145.6B"]))["virtual_stages"] == 2  # 80 layers / 8 stages = 10
  assert _values(M.row_features(rows["sc21_a100_529.6B"]))["virtual_stages"] == 3  # 105 / 35 = 3
  v = _values(M.row_features(rows["korthikanti_1T_sp_selective"]))  # Korthikanti: interleaving only 175B / 530B
  assert (v["schedule"], v["virtual_stages"], v["optimizer_sharding"]) == ("1f1b", 1, "none")
  assert _values(M.row_features(rows["torchtitan_llama31_8b_cp4"]))["context_parallel"] == "all_gather"


def test_fp8_rows_map_to_the_fp8_key(rows):
  r = rows["dgxc_paxml_gpt_5b_fp8_16"]
  assert _values(M.row_features(r))["matmul_precision"] == "fp8"
  assert M.feature_pairs("matmul_precision", M.row_features(r)["matmul_precision"]) == {
      "model.matmul_precision": "fp8"}


def test_an_unknown_key_is_a_loud_per_row_failure(rows, monkeypatch):
  r = rows["dgxc_paxml_gpt_5b_fp8_16"]
  monkeypatch.setitem(M.FEATURE_KEYS, "matmul_precision", {"bf16": {}, "fp8": {"model.no_such_fp8_key": "fp8"}})
  with pytest.raises(ConfigError, match="model.no_such_fp8_key.*FEATURE_KEYS"):
    M.features_to_overrides(M.row_features(r))
  m = M.row_config(r)
  assert m.error.startswith("not compiled: matmul_precision path missing")
  assert not any("no_such_fp8_key" in o for o in m.overrides)  # never compiled without the feature


def test_a_feature_declared_not_modelled_compiles_without_it(rows, monkeypatch):
  r = rows["dgxc_paxml_gpt_5b_fp8_16"]
  monkeypatch.setitem(M.FEATURE_KEYS, "matmul_precision", {"bf16": {}, "fp8": {"model.no_such_fp8_key": None}})
  assert "model.no_such_fp8_key" not in M.features_to_overrides(M.row_features(r))


def test_row_config_of_a_row_without_new_features_builds(rows):
  m = M.row_config(rows["maxtext_v5e_16b_1x256"])
  assert m.error == ""
  cfg = M.build_config(m.overrides, 256)
  assert (cfg.model.n_layers, cfg.model.remat, cfg.model.attention, cfg.mesh.fsdp) == (32, "full", "splash", 256)
  assert (cfg.model.param_dtype, cfg.model.block) == ("float32", "parallel")


def test_a_framework_without_rules_is_an_error(rows):
  r = dataclasses.replace(rows["maxtext_v5e_16b_1x256"], framework="SomeOtherTrainer")
  with pytest.raises(ConfigError, match="no mapping rules"):
    M.row_features(r)
