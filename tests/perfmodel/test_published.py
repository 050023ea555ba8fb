"""perfmodel.calib.published: the published training rows as step times, their exclusions, and the scoring.

Hand computations below cite the row they check; the FLOP conventions are also checked by reproducing the MFU
each source published next to its number (never by fitting anything to the rows).
"""
import csv
import dataclasses
import math
import os

import pytest

from perfmodel import hardware
from perfmodel.calib import published as P

CSV_PATH = P.default_path()


@pytest.fixture(scope="module")
def rows():
  return {r.id: r for r in P.load(CSV_PATH)}


def test_maxtext_2023_row_converts_with_its_own_tflops_formula(rows):
  # maxtext_v5e_16b_1x256: 120 model TFLOP/s per chip; MaxText @76bd53b0f counts 6 * N_all * tokens plus causal
  # attention 6 L H hd S^2 per sequence. The 2023 synthetic 16B: parallel block (one RMSNorm), q/k/v/o of
  # 5120 x 32*256, single ReLU MLP 5120 x 32768 twice, tied 32768-token embedding, final norm.
  r = rows["maxtext_v5e_16b_1x256"]
  layer = 5120 + 4 * 5120 * 32 * 256 + 2 * 5120 * 32768
  n = 32 * layer + 32768 * 5120 + 5120
  assert P.n_params(r) == n == 16_274_068_480
  per_chip = 6 * n * 2048 * 6 + 6 * 32 * 32 * 256 * 2048 ** 2 * 6  # per_device_batch_size 6
  assert r.measured_step_s == pytest.approx(per_chip / 120e12, rel=1e-12)
  assert r.measured_step_s == pytest.approx(10.3286, abs=1e-4)
  # the README's MFU 61.1% is this rate over the 197 TFLOP/s peak
  assert P.flops_per_step(r) / (r.measured_step_s * 256 * 197e12) == pytest.approx(0.611, abs=0.003)
  assert (r.parallel_block, r.mlp, r.head_dim, r.tie_embeddings) == (True, "relu", 256, True)
  assert (r.data, r.fsdp, r.tensor, r.microbatches, r.remat) == (1, 256, 1, 1, "full")


def test_narayanan_row_uses_the_hardware_flops_with_recompute(rows):
  # sc21_a100_1.7B: 137 TFLOP/s per GPU on 32 GPUs, F = 96 B s l h^2 (1 + s/6h + V/16lh), B=512 s=2048 l=24 h=2304
  r = rows["sc21_a100_1.7B"]
  f = 96 * 512 * 2048 * 24 * 2304 ** 2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
  assert r.measured_step_s == pytest.approx(f / (137e12 * 32), rel=1e-12)
  assert r.measured_step_s == pytest.approx(3.528, abs=1e-3)
  assert r.precision == "fp16" and r.dtype == "bfloat16" and r.included


def test_tokens_per_second_rows(rows):
  # torchtitan_a100_llama213b_bs2_none: 2162 tokens/s per GPU, 64 GPUs, 128 sequences of 4096 tokens
  r = rows["torchtitan_a100_llama213b_bs2_none"]
  assert r.measured_step_s == pytest.approx(128 * 4096 / (2162 * 64), rel=1e-12)
  # torchtitan's MFU (6 N + 12 L H hd S per token) reproduces the published 61.1% with N counting the embedding
  assert P.flops_per_step(r) / (r.measured_step_s * 64 * 312e12) == pytest.approx(0.611, abs=0.002)
  # llmfoundry_mpt7b_a100_bf16_s2048_n8: 4641 tokens/s per GPU, 8 GPUs, 96 sequences of 2048 tokens; MFU 64.23%
  m = rows["llmfoundry_mpt7b_a100_bf16_s2048_n8"]
  assert m.measured_step_s == pytest.approx(96 * 2048 / (4641 * 8), rel=1e-12)
  assert P.n_params(m) == 6_649_024_512  # MPT-7B: no biases, tied embedding, no position table (ALiBi)
  assert P.flops_per_step(m) / (m.measured_step_s * 8 * 312e12) == pytest.approx(0.6423, abs=0.003)
  assert (m.mlp, m.fsdp, m.micro_batch, m.microbatches) == ("gelu", 8, 6, 2)  # gradient accumulation 2


def test_seconds_rows_and_the_megatron_convention(rows):
  # dgxc_nemo_llama31_8b_bf16_8: step 12.91 s as published; NeMo's model FLOPs per sequence are 4.74e14
  r = rows["dgxc_nemo_llama31_8b_bf16_8"]
  assert r.measured_step_s == 12.91
  assert P.flops_per_step(r) / r.global_batch == pytest.approx(4.74e14, rel=0.002)
  assert P.flops_per_step(r) / (12.91 * 8 * 989e12) == pytest.approx(0.5937, abs=0.002)  # published MFU
  assert (r.data, r.tensor, r.pipeline, r.sequence, r.microbatches) == (4, 1, 1, 2, 32)
  # korthikanti_22B_sp_selective: 1.1 s; 72 B s l h^2 (1 + s/6h + V/12lh) over 8 x 312 TFLOP/s gives MFU 41.5%
  k = rows["korthikanti_22B_sp_selective"]
  f = 72 * 4 * 2048 * 48 * 6144 ** 2 * (1 + 2048 / (6 * 6144) + 51200 / (12 * 48 * 6144))
  assert P.flops_per_step(k) == pytest.approx(f, rel=1e-12)
  assert f / (1.1 * 8 * 312e12) == pytest.approx(0.415, abs=0.003)
  assert (k.remat, k.remat_exact) == ("minimal", False)


def test_mfu_row_divides_by_the_chip_peak(rows):
  # megatron_h100_177b_strong_96: MFU 0.47 on 96 H100s (989 TFLOP/s bf16), Megatron FLOPs of 1152 x 4096 tokens
  r = rows["megatron_h100_177b_strong_96"]
  assert r.measured_step_s == pytest.approx(P.flops_per_step(r) / (0.47 * 96 * 989e12), rel=1e-12)
  assert not r.included and "layout" in r.exclude_reason  # TP/PP of the strong-scaling runs not published


def test_exclusions(rows):
  assert rows["dgxc_paxml_gpt_5b_fp8_16"].included and rows["dgxc_paxml_gpt_5b_fp8_16"].precision == "fp8"
  assert rows["mlperf40_google_maxtext_gpt3_512"].exclude_reason.startswith("int8")
  assert rows["mlperf40_google_maxtext_gpt3_512"].measured_step_s is None  # block interval includes evaluation
  assert "conflicting" in rows["maxtext_v6e_llama31_405b_tiering"].exclude_reason
  assert rows["dgxc_paxml_gpt_5b_bf16_16"].included
  reasons = [r.exclude_reason for r in rows.values() if not r.included]
  assert all(reasons) and len(rows) >= 175


def test_every_included_row_is_a_finite_positive_step_on_a_known_profile(rows):
  known = set(hardware.available())
  inc = [r for r in rows.values() if r.included]
  assert len(inc) >= 100
  for r in inc:
    assert r.measured_step_s is not None and math.isfinite(r.measured_step_s) and r.measured_step_s > 0, r.id
    assert r.hardware in known, r.id
    assert r.data * r.fsdp * r.tensor * r.pipeline * r.sequence == r.n_chips, r.id
    assert r.mlp in ("swiglu", "gelu", "relu") and r.precision in ("bf16", "fp16", "fp8"), r.id
    assert r.remat is None or r.remat in P.REMAT_NAMES, r.id
    assert P.flops_per_step(r) > 0, r.id
    o = r.overrides()
    assert o["model"]["n_layers"] == r.n_layers and o["mesh"]["fsdp"] == r.fsdp and o["data"]["global_batch"] > 0


def test_hardware_caveats(rows):
  assert "96 GB" in rows["torchtitan_llama31_8b_8gpu_eager"].hardware_caveat
  assert "A3" in rows["maxtext_a3_llama2_7b_8"].hardware_caveat
  assert rows["dgxc_nemo_llama31_8b_bf16_8"].hardware_caveat == ""


def _csv(tmp_path, **over):
  base = {"id": "x", "source": "github some/repo README.md (table row 1)", "framework": "Megatron-LM (2021)",
          "model": "GPT 1B", "n_layers": "24", "d_model": "2048", "n_heads": "16", "n_kv_heads": "16", "d_ff": "8192",
          "vocab": "51200", "seq_len": "2048", "global_batch_seqs": "64", "micro_batch": "1", "dp": "8", "fsdp": "",
          "tp": "1", "pp": "1", "cp": "1", "vpp": "", "recompute": "full", "precision": "bf16", "chip": "A100-SXM-80GB",
          "n_chips": "8", "metric": "seconds per iteration", "value": "2.5", "metric_definition": "iteration time",
          "notes": ""}
  base.update(over)
  path = os.path.join(tmp_path, "rows.csv")
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(base))
    w.writeheader()
    w.writerow(base)
  return P.load(path)[0]


def test_synthetic_rows_include_and_exclude(tmp_path):
  ok = _csv(tmp_path)
  assert ok.included and ok.measured_step_s == 2.5 and ok.mlp == "gelu" and ok.convention == "megatron"
  assert "unknown chip" in _csv(tmp_path, chip="Gaudi 2").exclude_reason
  assert "mixture of experts" in _csv(tmp_path, model="Mixtral 8x7B MoE").exclude_reason
  assert "does not multiply" in _csv(tmp_path, dp="4").exclude_reason
  assert _csv(tmp_path, precision="fp8 (TE)").included  # scored as fp8 rows (held out)
  assert _csv(tmp_path, precision="int8 (AQT)").exclude_reason.startswith("int8")
  assert "sliding-window" in _csv(tmp_path, notes="sliding window attention, LAMB").exclude_reason
  assert "n_layers" in _csv(tmp_path, n_layers="").exclude_reason
  tok = _csv(tmp_path, metric="tokens/s per GPU", value="1000")
  assert tok.measured_step_s == pytest.approx(64 * 2048 / (1000 * 8))


def test_missing_csv_names_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="benchmarks/data/published_training.csv"):
    P.load(os.path.join(tmp_path, "nope", "published_training.csv"))


def test_the_rows_live_in_the_repository():
  assert os.path.commonpath([P.default_path(), P.ROOT]) == P.ROOT and os.path.exists(P.default_path())
  assert os.path.exists(os.path.join(os.path.dirname(P.default_path()), "published_training.md"))


def test_heldout_split_is_the_rule_and_covers_the_original_rows():
  split = P.load_split()
  assert len(split) == 175  # the rows the split was fixed on; later rows are held out by being absent
  with open(CSV_PATH, newline="") as f:
    precision = {row["id"]: P.precision_of(row["precision"]) for row in csv.DictReader(f)}
  for row_id, (name, why) in split.items():
    assert (name == "heldout") == bool(P.heldout_rule(row_id, precision[row_id])), row_id
    assert why == P.heldout_rule(row_id, precision[row_id])
  held = [i for i, (name, _) in split.items() if name == "heldout"]
  assert all(split[i][0] == "heldout" for i in precision if i in split and precision[i] == "fp8")
  assert 0.3 < len(held) / len(split) < 0.5  # 40 fp8 rows + about a quarter of the rest


def test_rows_added_after_the_split_are_held_out(tmp_path):
  r = _csv(tmp_path, id="a_row_added_later")
  assert r.split == "heldout" and "added after" in r.split_why


def test_remat_mapping():
  assert P.remat_of("full (remat_policy=full)") == ("full", True)
  assert P.remat_of("minimal (remat_policy=minimal)") == ("minimal", True)
  assert P.remat_of("minimal_flash") == ("minimal_flash", False)
  assert P.remat_of("SAVE_QKV_OUT_PROJ (Praxis checkpoint policy)") == ("save_qkv_proj", False)
  assert P.remat_of("save_dot_except_mlpwi") == ("save_dot_except_mlp", False)
  assert P.remat_of("none") == ("none", True)
  assert P.remat_of("") == (None, False)
  assert P.remat_of("selective (layer)") == (None, False)
  # MaxText's host offload: nothing but what is offloaded stays, on the chip that is full recomputation
  assert P.remat_of("custom: offload decoder_layer_input, out_proj, query_proj, key_proj, value_proj") == (
      "qkv_proj_offloaded", False)
  assert P.remat_of("custom: offload decoder_layer_input") == ("full", False)


def test_llama3_and_megascale_rows_match_their_papers(rows):
  # Llama 3 405B (Table 3: 126 layers, 16384 wide, FFN 53248, 128 / 8 heads, vocab 128,000) on 8,192 H100s, Table 4:
  # 16M tokens per batch, 430 TFLOP/s per GPU = BF16 MFU 43% of 989
  r = rows["llama3_405b_h100_8192"]
  assert P.n_params(r) == pytest.approx(405e9, rel=0.005) and r.tokens_per_step == 2048 * 8192
  assert (r.convention, r.data, r.tensor, r.pipeline, r.sequence, r.remat) == ("palm", 64, 8, 16, 1, "none")
  assert r.included and r.split == "heldout" and r.virtual_stages == 0  # interleaved, V not stated
  assert rows["llama3_405b_h100_16384_cp16"].data * 8 * 16 * 16 == 16384
  # MegaScale Table 2, Megatron-LM on 12,288 GPUs: 8.57 s per iteration of 6144 x 2048 tokens = 1466.8k tokens/s;
  # Megatron's model FLOPs (vocab 64,000) over the A100 peak give the published MFU 41.2%
  m = rows["megascale_megatronlm_175b_12288"]
  assert m.measured_step_s == 8.57 and m.tokens_per_step / 8.57 == pytest.approx(1466.8e3, rel=2e-3)
  assert P.flops_per_step(m, "megatron") / (8.57 * 12288 * 312e12) == pytest.approx(0.412, abs=0.002)
  assert (m.hardware, m.data, m.virtual_stages, m.vocab_size) == ("a100", 192, 6, 64000)
  assert not rows["megascale_175b_12288"].included  # sliding-window attention, window not published


def _mixtral(tmp_path, **over):
  """Mixtral 8x7B as a Megatron-style MoE row: dp counts the expert-parallel ranks (EP inside DP)."""
  row = dict(framework="Megatron-Core (NeMo)", model="Mixtral 8x7B", n_layers="32", d_model="4096", n_heads="32",
             n_kv_heads="8", d_ff="", vocab="32000", seq_len="4096", global_batch_seqs="256", dp="16", tp="1", pp="4",
             n_chips="64", chip="H100 SXM", metric="model TFLOP/s per chip", value="400",
             metric_definition="Megatron num_floating_point_operations", head_dim="128", n_experts="8",
             experts_per_token="2", moe_d_ff="14336", n_shared_experts="", first_dense_layers="", ep="8", etp="",
             capacity_factor="", routing="dropless", split="")
  row.update(over)
  return _csv(tmp_path, **row)


def test_moe_rows_count_routed_experts_and_split_dp_over_ep(tmp_path):
  r = _mixtral(tmp_path)
  assert r.included, r.exclude_reason
  assert (r.n_experts, r.experts_per_token, r.expert, r.data, r.capacity_factor) == (8, 2, 8, 2, 0.0)
  # Mistral's published counts: 46.7B parameters, 12.9B used per token
  assert P.n_params(r) == pytest.approx(46.7e9, rel=0.01)
  assert P.n_params(r, active=True) == pytest.approx(12.9e9, rel=0.01)
  # Megatron's MoE FLOPs take the routed experts' width (2 x 14336) where a dense row has d_ff
  dense = dataclasses.replace(r, n_experts=0, d_ff=2 * 14336)
  assert P.flops_per_step(r) == pytest.approx(P.flops_per_step(dense), rel=1e-3)
  assert P.flops_per_step(r, "maxtext_6n_causal") > 6 * 12.9e9 * 256 * 4096
  # the same layout written with ep outside dp (dp x ep x ... = chips) is kept as written
  assert _mixtral(tmp_path, dp="2").data == 2
  assert "expert width" in _mixtral(tmp_path, moe_d_ff="").exclude_reason
  cap = _mixtral(tmp_path, routing="capacity", capacity_factor="1.25")
  assert cap.capacity_factor == 1.25


def test_moe_row_maps_to_the_capacity_program(tmp_path):
  from perfmodel.calib import published_mapping as M
  r = _mixtral(tmp_path)
  flat = dict(o[len("--config."):].split("=", 1) for o in M.row_config(r).overrides)
  assert (flat["model.n_experts"], flat["model.moe_impl"], flat["model.capacity_factor"], flat["mesh.expert"],
          flat["mesh.data"]) == ("8", "capacity", "1.0", "8", "2")
  assert flat["mesh.form"] == "shard_map"  # explicit all_to_all: the jit form's dispatch sorts the global batch
  assert M.row_config(r).error == ""


def test_moe_rows_have_their_own_split_and_record(tmp_path):
  from perfmodel.calib import published_validate as V
  moe_csv = os.path.join(P.DATA_DIR, "published_moe_training.csv")
  assert P.split_path(moe_csv).endswith("published_moe_split.csv")
  assert P.split_path(P.default_path()) == P.SPLIT_CSV
  assert V.record_path(moe_csv).endswith("published_moe_validation.json")
  assert V.record_path(None) == V.JSON_PATH
  rows = P.load(moe_csv)
  with open(P.split_path(moe_csv), newline="") as f:
    split = {row["id"]: row["split"] for row in csv.DictReader(f)}
  assert {r.id for r in rows} == set(split)  # the split was fixed over every row
  for r in rows:
    assert (r.split == "heldout") == bool(P.heldout_rule(r.id, r.precision)), r.id
  assert sum(r.included for r in rows) >= 15
