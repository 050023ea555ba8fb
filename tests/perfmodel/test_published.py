"""perfmodel.calib.published: the published training rows as step times, their exclusions, and the scoring.

Hand computations below cite the row they check; the FLOP conventions are also checked by reproducing the MFU
each source published next to its number (never by fitting anything to the rows).
"""
import csv
import math
import os

import pytest

from perfmodel import hardware
from perfmodel.calib import published as P

CSV_PATH = P.default_path()
needs_csv = pytest.mark.skipif(not os.path.exists(CSV_PATH), reason=f"published rows not at {CSV_PATH}")


@pytest.fixture(scope="module")
def rows():
  return {r.id: r for r in P.load(CSV_PATH)}


@needs_csv
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


@needs_csv
def test_narayanan_row_uses_the_hardware_flops_with_recompute(rows):
  # sc21_a100_1.7B: 137 TFLOP/s per GPU on 32 GPUs, F = 96 B s l h^2 (1 + s/6h + V/16lh), B=512 s=2048 l=24 h=2304
  r = rows["sc21_a100_1.7B"]
  f = 96 * 512 * 2048 * 24 * 2304 ** 2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
  assert r.measured_step_s == pytest.approx(f / (137e12 * 32), rel=1e-12)
  assert r.measured_step_s == pytest.approx(3.528, abs=1e-3)
  assert r.precision == "fp16" and r.dtype == "bfloat16" and r.included


@needs_csv
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


@needs_csv
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


@needs_csv
def test_mfu_row_divides_by_the_chip_peak(rows):
  # megatron_h100_177b_strong_96: MFU 0.47 on 96 H100s (989 TFLOP/s bf16), Megatron FLOPs of 1152 x 4096 tokens
  r = rows["megatron_h100_177b_strong_96"]
  assert r.measured_step_s == pytest.approx(P.flops_per_step(r) / (0.47 * 96 * 989e12), rel=1e-12)
  assert not r.included and "layout" in r.exclude_reason  # TP/PP of the strong-scaling runs not published


@needs_csv
def test_exclusions(rows):
  assert not rows["dgxc_paxml_gpt_5b_fp8_16"].included
  assert rows["dgxc_paxml_gpt_5b_fp8_16"].exclude_reason.startswith("fp8")
  assert rows["mlperf40_google_maxtext_gpt3_512"].exclude_reason.startswith("int8")
  assert rows["mlperf40_google_maxtext_gpt3_512"].measured_step_s is None  # block interval includes evaluation
  assert "conflicting" in rows["maxtext_v6e_llama31_405b_tiering"].exclude_reason
  assert rows["dgxc_paxml_gpt_5b_bf16_16"].included
  reasons = [r.exclude_reason for r in rows.values() if not r.included]
  assert all(reasons) and len(rows) == 175


@needs_csv
def test_every_included_row_is_a_finite_positive_step_on_a_known_profile(rows):
  known = set(hardware.available())
  inc = [r for r in rows.values() if r.included]
  assert len(inc) >= 100
  for r in inc:
    assert r.measured_step_s is not None and math.isfinite(r.measured_step_s) and r.measured_step_s > 0, r.id
    assert r.hardware in known, r.id
    assert r.data * r.fsdp * r.tensor * r.pipeline * r.sequence == r.n_chips, r.id
    assert r.mlp in ("swiglu", "gelu", "relu") and r.precision in ("bf16", "fp16"), r.id
    assert r.remat is None or r.remat in P.REMAT_NAMES, r.id
    assert P.flops_per_step(r) > 0, r.id
    o = r.overrides()
    assert o["model"]["n_layers"] == r.n_layers and o["mesh"]["fsdp"] == r.fsdp and o["data"]["global_batch"] > 0


@needs_csv
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
  assert _csv(tmp_path, precision="fp8 (TE)").exclude_reason.startswith("fp8")
  assert "n_layers" in _csv(tmp_path, n_layers="").exclude_reason
  tok = _csv(tmp_path, metric="tokens/s per GPU", value="1000")
  assert tok.measured_step_s == pytest.approx(64 * 2048 / (1000 * 8))


def test_missing_csv_names_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="published_training.csv"):
    P.load(os.path.join(tmp_path, "nope", "published_training.csv"))


def test_remat_mapping():
  assert P.remat_of("full (remat_policy=full)") == ("full", True)
  assert P.remat_of("minimal (remat_policy=minimal)") == ("minimal", True)
  assert P.remat_of("SAVE_QKV_OUT_PROJ (Praxis checkpoint policy)") == ("save_qkv_proj", False)
  assert P.remat_of("save_dot_except_mlpwi") == ("save_dot_except_mlp", False)
  assert P.remat_of("none") == ("none", True)
  assert P.remat_of("") == (None, False)
  assert P.remat_of("selective (layer)") == (None, False)


def test_kendall_tau():
  assert P.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
  assert P.kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
  assert P.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
  assert P.kendall_tau([1, 1], [1, 1]) is None
  with pytest.raises(ValueError):
    P.kendall_tau([1], [1, 2])


def _fake(i, step, chip="h100", table="t1", source="s1"):
  return P.PublishedRun(
      id=f"r{i}", source=source, source_key=source, table=table, framework="f", model="m", n_layers=1, d_model=1,
      n_heads=1, n_kv_heads=1, head_dim=1, d_ff=1, vocab_size=1, mlp="gelu", tie_embeddings=False,
      parallel_block=False, learned_positions=False, biases=False, seq_len=1, global_batch=1, remat="full",
      remat_exact=True, recompute_raw="full", dtype="bfloat16", precision="bf16", data=1, fsdp=1, tensor=1, pipeline=1,
      sequence=1, micro_batch=1, microbatches=1, virtual_stages=1, chip=chip, hardware=chip, hardware_caveat="",
      n_chips=1, metric="seconds per step", value=step, convention=None, measured_step_s=step, included=True,
      exclude_reason="")


def test_summarize_on_synthetic_predictions():
  runs = [_fake(0, 1.0), _fake(1, 2.0), _fake(2, 4.0, chip="a100", table="t2", source="s2"),
          _fake(3, 3.0, chip="a100", table="t2", source="s2")]
  s = P.summarize(runs, {r.id: 1.1 * r.measured_step_s for r in runs})
  assert s["n_rows"] == 4 and s["mape_pct"] == pytest.approx(10.0) and s["mean_signed_pct"] == pytest.approx(10.0)
  assert s["kendall_tau"]["t1"]["tau"] == 1.0 and s["kendall_tau"]["t2"]["tau"] == 1.0
  assert s["kendall_tau_mean"] == 1.0
  assert set(s["by_chip"]) == {"h100", "a100"} and s["by_chip"]["a100"]["mape_pct"] == pytest.approx(10.0)
  assert set(s["by_source"]) == {"s1", "s2"}
  # an aligned sequence works too; a reversed ranking inside one table gives tau -1; missing predictions are skipped
  s2 = P.summarize(runs, [0.9, 0.8, 1.0, None])
  assert s2["n_rows"] == 3 and s2["n_skipped"] == 1
  assert s2["kendall_tau"]["t1"]["tau"] == -1.0 and s2["kendall_tau"]["t2"]["tau"] is None
  assert s2["rows"][0]["err_pct"] == pytest.approx(-10.0)
