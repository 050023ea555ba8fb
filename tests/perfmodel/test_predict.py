"""predict, the one entry point, on each route: the real compiled step (small), the traced rank program and the
analytic graph of a 70B model at 8192 devices; the graphs of the three routes cross-checked."""
import json
import os
import subprocess
import sys

import pytest

from framework.config import from_dict, validate
from perfmodel import hardware, predict, program
from perfmodel.graph import analytic, from_jaxpr
from perfmodel.graph import from_hlo as G

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64),
             data=dict(seq_len=32, global_batch=8), mesh=dict(data=2, tensor=2), train=dict(steps=5))


@pytest.fixture(scope="module")
def small():
  cfg = validate(from_dict(SMALL), 4)
  return cfg, program.train_step(cfg)


def test_predict_train_from_compiled_step(small):
  cfg, cap = small
  p = predict.predict(cfg, hardware.load("cpu"), captured=cap)
  assert p.route == "compile" and p.composition.startswith("calibrated")
  out = p.to_dict()
  assert out["step_time_s"] > 0 and out["tokens_per_s"] > 0 and 0 < out["mfu"] < 1
  m = cap.memory
  assert out["peak_memory_bytes"] == (m["argument_size_in_bytes"] + m["output_size_in_bytes"]
                                      - m["alias_size_in_bytes"] + m["temp_size_in_bytes"])
  assert set(out["breakdown"]["by_kind_s"]) >= {"dot", "fusion", "collective"}
  assert sum(out["breakdown"]["priced_by"].values()) > 0
  # the analytic memory model is an estimate: report-level agreement (same order of magnitude)
  ratio = out["memory_analytic"]["total"] / out["peak_memory_bytes"]
  assert 0.2 < ratio < 5, ratio
  # Per-device FLOPs of the compiled graph (loops x trip count) vs the framework's FLOP convention / 4
  # devices: a sanity band, not an identity (the convention counts full-T attention and the LM head; the
  # compiled program adds replicated norms/embedding and the optimizer's elementwise work).
  model_dev = out["model_flops_per_step"] / 4
  assert 0.4 < out["flops_per_device"] / model_dev < 3


def test_analytic_graph_agrees_with_compiled_graph(small):
  cfg, cap = small
  gc = G.from_hlo_text(cap.hlo_text, 4)
  ga = analytic.build(cfg)
  dots_c = sum(n.flops * k for n, k in gc.walk() if n.kind == "dot")
  dots_a = sum(n.flops * k for n, k in ga.walk() if n.kind == "dot")
  assert dots_a == pytest.approx(dots_c, rel=0.25)
  kinds_c = {n.collective.kind for n, _ in gc.walk() if n.collective}
  kinds_a = {n.collective.kind for n, _ in ga.walk() if n.collective}
  assert "all-reduce" in kinds_c and "all-reduce" in kinds_a


def test_predict_70b_at_8192_devices_without_materialising():
  cfg = validate(from_dict(dict(
      model=dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, max_seq_len=4096,
                 dtype="bfloat16", param_dtype="float32", remat="full"),
      data=dict(seq_len=4096, global_batch=1024), mesh=dict(data=16, fsdp=64, tensor=8))), 8192)
  out = predict.predict(cfg, "h100", method="analytic").to_dict()
  assert out["n_devices"] == 8192 and out["route"] == "analytic"
  assert 0.01 < out["mfu"] < 1
  # 6ND-style model FLOPs split over 8192 devices, +1/3 for full remat's recompute of the forward
  per_dev = out["model_flops_per_step"] / 8192
  assert out["flops_per_device"] == pytest.approx(per_dev * 4 / 3, rel=0.1)
  assert out["peak_memory_bytes"] < hardware.load("h100").mem_bytes
  assert out["predict_s"] < 5


def test_predict_70b_at_8192_devices_from_the_real_rank_program():
  """The rank-program route (the default above 512 devices for the cpu profile, and for a TPU/GPU profile
  without the target compiler installed): the shard_map per-device body traced on an AbstractMesh of 8192
  (the program emulation runs), priced as a jaxpr graph; nothing is compiled for 8192 devices."""
  cfg = validate(from_dict(dict(
      model=dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, max_seq_len=4096,
                 dtype="bfloat16", param_dtype="float32", remat="full"),
      data=dict(seq_len=4096, global_batch=1024), mesh=dict(data=16, fsdp=64, tensor=8))), 8192)
  assert predict.resolve_method(8192) == "auto_large"  # above 512 devices: no N-device compile
  out = predict.predict(cfg, "h100", method="rank_program").to_dict()
  assert out["route"] == "rank_program" and out["n_devices"] == 8192 and "route_fallback_reason" not in out
  per_dev = out["model_flops_per_step"] / 8192
  # per-rank dots of the real program (fwd + bwd + full-remat recompute) vs 6ND/8192 x 4/3
  assert out["flops_per_device"] == pytest.approx(per_dev * 4 / 3, rel=0.15)
  # the rank holds exactly 1/512 of the layer matrices (fsdp 64 x tensor 8); embeddings add a little
  n_params = cfg.model.n_params(embeddings=True)
  assert 4 * n_params / 512 <= out["rank_param_bytes"] <= 4 * n_params / 512 * 1.1
  kinds = out["breakdown"]["by_kind_s"]
  assert kinds["dot"] > 0 and kinds["collective"] > 0
  assert 0.001 < out["mfu"] < 1 and out["step_time_s"] > 0
  assert out["predict_s"] < 90


@pytest.mark.entry
def test_cli_predict_infer_prints_json():
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  r = subprocess.run([sys.executable, "-m", "perfmodel", "predict", "--config",
                      "experiments/configs/quickstart.py:runlocal=True", "--hardware", "cpu", "--mode", "infer",
                      "--batch", "2", "--prompt-len", "16", "--gen-len", "8",
                      # learned: nothing to profile first, so no host timing in a test of the command line
                      "--backend", "learned"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert r.returncode == 0, r.stderr[-2000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["ttft_s"] > 0 and out["tpot_s"] > 0 and out["tokens_per_s"] > 0


def test_rank_program_graph_matches_compiled_dots(small):
  """The jaxpr graph of the traced per-rank program and the compiled per-device HLO agree on matmul FLOPs."""
  cfg, cap = small
  prog = program.rank_program(cfg)
  gj, _ = from_jaxpr.build(prog.body, cfg.mesh.sizes())
  gc = G.from_hlo_text(cap.hlo_text, 4)
  dots_j = sum(n.flops * k for n, k in gj.walk() if n.kind == "dot")
  dots_c = sum(n.flops * k for n, k in gc.walk() if n.kind == "dot")
  assert dots_j == pytest.approx(dots_c, rel=0.1)
  assert {n.collective.kind for n, _ in gj.walk() if n.collective} >= {"all-reduce"}


def test_cli_dispatches_emulate_to_the_emulation_package(monkeypatch, capsys):
  import perfmodel.emulate.cli as emu_cli
  from perfmodel import cli
  seen = {}
  monkeypatch.setattr(emu_cli, "main", lambda argv=None: seen.setdefault("argv", argv) and 0)
  cli.main(["emulate", "--config", "x.py", "--mesh", "data=2"])
  assert seen["argv"] == ["--config", "x.py", "--mesh", "data=2"]


def test_prediction_json_keeps_every_field_that_applies_and_names_the_total():
  p = predict.Prediction(mode="infer", config="c", hardware="cpu", calibrated=True, backends=["learned"], tpot_s=1.0,
                         generation_s=3.0)
  d = p.to_dict()
  assert d["total_s"] == 3.0 and d["generation_s"] == 3.0 and "step_time_s" not in d
  t = predict.Prediction(mode="train", config="c", hardware="cpu", calibrated=True, backends=[], wall_s=0.5)
  assert t.to_dict()["total_s"] == 0.5
  assert "total_s" not in predict.Prediction(mode="train", config="c", hardware="h100", calibrated=False,
                                             backends=[]).to_dict()
