"""perfmodel.calib.published_score / published_checks: scores beside the constant-MFU baseline, plausibility flags."""
import dataclasses

import pytest

from perfmodel import memory
from perfmodel.calib import published as P
from perfmodel.calib import published_checks as C
from perfmodel.calib import published_mapping as M
from perfmodel.calib import published_score as S


@pytest.fixture(scope="module")
def rows():
  return {r.id: r for r in P.load()}


def test_baseline_is_half_the_peak_on_six_n_plus_causal_attention(rows):
  # maxtext_v5e_16b_1x256 publishes 120 TFLOP/s per chip in this very convention: its MFU is 120 / 197 = 0.609, so
  # the baseline (MFU 0.5) predicts the step 0.609 / 0.5 times longer than measured
  r = rows["maxtext_v5e_16b_1x256"]
  assert S.model_flops(r) == P.flops_per_step(r, "maxtext_6n_causal")
  assert S.baseline_step_s(r) == pytest.approx(r.measured_step_s * (120 / 197) / 0.5, rel=1e-9)
  assert S.mfu_of(r, r.measured_step_s) == pytest.approx(120 / 197, rel=1e-9)


def test_kendall_tau():
  assert S.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
  assert S.kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
  assert S.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
  assert S.kendall_tau([1, 1], [1, 1]) is None
  with pytest.raises(ValueError):
    S.kendall_tau([1], [1, 2])


def _fake(r, i, step, table, chip="h100"):
  return dataclasses.replace(r, id=f"r{i}", measured_step_s=step, table=table, source_key=table, hardware=chip)


def test_score_puts_the_baseline_beside_the_model_on_the_same_rows(rows):
  base = rows["torchtitan_llama31_8b_8gpu_eager"]  # h100, 8 chips
  runs = [_fake(base, 0, 1.0, "t1"), _fake(base, 1, 2.0, "t1"), _fake(base, 2, 4.0, "t2", chip="a100"),
          _fake(base, 3, 3.0, "t2", chip="a100")]
  s = S.score(runs + [_fake(base, 9, 5.0, "t3")], {r.id: 1.1 * r.measured_step_s for r in runs})
  m, b = s["model"], s["baseline"]
  assert s["n"] == 4 and s["n_skipped"] == 1
  assert m["mape_pct"] == pytest.approx(10.0) and m["mean_signed_pct"] == pytest.approx(10.0)
  assert m["tau_global"] == 1.0 and m["tau_tables"] == 1.0 and set(m["by_chip"]) == {"h100", "a100"}
  # the baseline predicts the same step for equal rows of one chip: its ranking inside each table is all ties
  bl = {r.id: S.baseline_step_s(r) for r in runs}
  errs = [100 * (bl[r.id] / r.measured_step_s - 1) for r in runs]
  assert b["mape_pct"] == pytest.approx(sum(abs(e) for e in errs) / 4)
  assert b["tau_tables"] is None and b["by_chip"]["a100"]["n"] == 2
  line = S.lines("x", s)[0]
  assert "model 10.0%" in line and f"baseline {b['mape_pct']:.1f}%" in line


def test_best_matmul_fraction_comes_from_the_profile():
  assert C.best_matmul_fraction("h100")[0] == pytest.approx(0.8033)  # MAMF table, above the curve's 0.792
  v5p, src = C.best_matmul_fraction("tpu_v5p")
  assert v5p == pytest.approx(0.923) and "stand-in" in src  # the v5e curve stands in, as in the pricing
  fp8, _ = C.best_matmul_fraction("h100", "fp8")
  assert fp8 > 1.0  # fp8 matmuls reach more than the bf16 peak


def test_mfu_flag(rows):
  r = rows["torchtitan_llama31_8b_8gpu_eager"]
  assert C.mfu_flag(r, {"mfu": 0.5, "step_time_s": 1.0}) is None
  f = C.mfu_flag(r, {"mfu": 0.9, "step_time_s": 1.0, "flops_per_device": 0.85 * 989e12})
  assert f["flag"] == "mfu_above_best_matmul" and f["program_flop_fraction"] == pytest.approx(0.85)


def _without_features(m):
  """The row's overrides as a program compiled without its new features (what the committed programs are)."""
  feature_keys = {k for name, fact in m.features.items() if name not in ("recompute", "program_layers")
                  for k in M.feature_pairs(name, fact)}
  return [o for o in m.overrides if o[len("--config."):].split("=")[0] not in feature_keys]


def test_memory_diagnosis_names_the_missing_distributed_optimizer(rows):
  r = rows["megatron_h100_177B"]  # dp 48: Adam moments replicated 48 times in a program without ZeRO-1
  m = M.row_config(r)
  program = _without_features(m)
  terms = memory.analytic(M.build_config(program, r.n_chips))
  need = 80e9 + 0.5 * terms.opt_state  # over the chip, but under it once the moments are sharded over dp
  d = C.memory_diagnosis(r, m.features, program, {"memory_analysis": {"needed": need}})
  assert d.startswith("needs ZeRO-1") and "dp=48" in d and "fits with them" in d
  far = C.memory_diagnosis(r, m.features, program, {"memory_analysis": {"needed": 10 * need}})
  assert "still" in far and "also the mapping" in far


def test_memory_diagnosis_without_a_missing_feature_points_at_the_mapping(rows):
  r = rows["maxtext_v5e_16b_1x256"]
  m = M.row_config(r)
  d = C.memory_diagnosis(r, m.features, m.overrides, {"memory_analysis": {"needed": 30e9}})
  assert d.startswith("mapping or model") and "largest analytic term" in d
