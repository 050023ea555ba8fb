"""Hugging Face interop (framework/hf.py): our model *is* Llama (and, with q/k/v biases, Qwen2).

Small randomly initialised ``LlamaForCausalLM`` (plain and Llama 3.1-scaled RoPE) and ``Qwen2ForCausalLM``
models are built locally (no download), saved with
``save_pretrained``, loaded into PrismLLM, and the logits compared; then our export is loaded back by
transformers. Tolerance 1e-4 absolute on float32 logits of magnitude ~1-10: both sides compute in
float32 with different op orders (fused einsums vs. separate matmuls), which accounts for ~1e-6.
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed: HF interop tests need torch (CPU build is fine)")
transformers = pytest.importorskip("transformers", reason="transformers not installed: pip install transformers")

from framework import hf  # noqa: E402
from framework import model as model_lib  # noqa: E402
from framework.config import Config, MeshConfig, OptimConfig, TrainConfig  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # with theta 5000 and head_dim 16 the 8 wavelengths (6.3 ... 11560) fall in all three bands of
               # original_max 32: kept (< 8), smoothed (8 ... 32), divided by factor (> 32)
               "original_max_position_embeddings": 32}
CASES = {
    # name: (architecture, config kwargs, scan_layers)
    "gqa_untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False), True),
    "mha_tied": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True), True),
    "gqa_headdim_unrolled": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                                           tie_word_embeddings=False), False),
    "llama3_rope_scaling": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                          rope_scaling=LLAMA3_ROPE), True),
    "qwen2_untied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False), True),
    "qwen2_tied_unrolled": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
                            False),
}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def _hf_model(case, seed=0):
  arch, kw, _ = CASES[case]
  config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[arch])
  cfg = config_cls(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
                   attn_implementation="eager", **kw)
  torch.manual_seed(seed)
  m = model_cls(cfg).eval()
  # Random (not default) values everywhere, norms and Qwen2's q/k/v biases included, so every tensor's mapping
  # matters and the logits are O(1-10), not the near-zero logits of a 0.02-std init.
  with torch.no_grad():
    for name, p in m.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  return m


def _tokens(seed=1, b=2, t=12):
  return np.random.default_rng(seed).integers(0, 300, size=(b, t)).astype(np.int32)


def _hf_logits(m, tokens):
  with torch.no_grad():
    return m(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def _our_logits(cfg, params, tokens):
  return np.asarray(model_lib.build(cfg).apply({"params": jax.tree.map(jnp.asarray, params)}, jnp.asarray(tokens)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_checkpoint_logits_match_transformers(case, tmp_path):
  arch, kw, scan = CASES[case]
  m = _hf_model(case)
  m.save_pretrained(tmp_path / "hf")
  cfg, params = hf.load(str(tmp_path / "hf"), scan_layers=scan)
  assert cfg.tie_embeddings == kw["tie_word_embeddings"] and cfg.n_kv_heads == kw["num_key_value_heads"]
  assert cfg.hd == kw.get("head_dim", 16) and cfg.rope_theta == 5000.0
  assert cfg.qkv_bias == (arch == "qwen2") and cfg.rope_scaling == ("llama3" if "rope_scaling" in kw else "none")
  assert ("layers" in params) == scan and ("lm_head" in params) != cfg.tie_embeddings
  n_hf = sum(p.numel() for p in m.parameters())
  assert cfg.n_params() == n_hf
  toks = _tokens()
  ref, got = _hf_logits(m, toks), _our_logits(cfg, params, toks)
  assert np.abs(ref).max() > 1.0  # non-trivial logits, so 1e-4 is a real bar
  np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
  if cfg.rope_scaling == "llama3":  # the scaling is exercised: plain RoPE on the same weights is far off
    plain = _our_logits(dataclasses.replace(cfg, rope_scaling="none"), params, toks)
    assert np.abs(plain - ref).max() > 1e-2


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_loads_in_transformers(case, tmp_path):
  arch, kw, scan = CASES[case]
  m = _hf_model(case, seed=3)
  m.save_pretrained(tmp_path / "hf")
  cfg, params = hf.load(str(tmp_path / "hf"), scan_layers=scan)
  hf.save(params, cfg, str(tmp_path / "out"))
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
  assert type(back) is type(m)
  # Bit-exact weights both ways (float32 throughout), and the same config.
  ref_sd, got_sd = m.state_dict(), back.state_dict()
  assert set(ref_sd) == set(got_sd)
  for k in ref_sd:
    assert torch.equal(ref_sd[k], got_sd[k]), k
  for attr in ("num_key_value_heads", "tie_word_embeddings", "intermediate_size", "rms_norm_eps"):
    assert getattr(back.config, attr) == getattr(m.config, attr), attr
  head_dim = lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # noqa: E731
  assert head_dim(back.config) == head_dim(m.config)
  assert back.config.rope_parameters["rope_theta"] == 5000.0
  assert back.config.rope_parameters["rope_type"] == m.config.rope_parameters["rope_type"]
  if "rope_scaling" in kw:
    for k, v in LLAMA3_ROPE.items():
      assert back.config.rope_parameters[k] == v, k
  toks = _tokens(seed=4)
  np.testing.assert_allclose(_hf_logits(back, toks), _our_logits(cfg, params, toks), rtol=0, atol=1e-4)


def test_sharded_checkpoints_both_ways(tmp_path):
  m = _hf_model("gqa_untied", seed=5)
  m.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
  assert (tmp_path / "hf" / hf.INDEX_FILE).exists()
  cfg, params = hf.load(str(tmp_path / "hf"))
  toks = _tokens(seed=6)
  np.testing.assert_allclose(_our_logits(cfg, params, toks), _hf_logits(m, toks), rtol=0, atol=1e-4)
  hf.save(params, cfg, str(tmp_path / "out"), max_shard_bytes=40_000)
  idx = json.loads((tmp_path / "out" / hf.INDEX_FILE).read_text())
  assert len(set(idx["weight_map"].values())) > 1
  back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
  np.testing.assert_allclose(_hf_logits(back, toks), _hf_logits(m, toks), rtol=0, atol=1e-6)


def test_bfloat16_export_loads_in_transformers(tmp_path):
  m = _hf_model("mha_tied", seed=7)
  m.save_pretrained(tmp_path / "hf")
  cfg, params = hf.load(str(tmp_path / "hf"))
  hf.save(params, cfg, str(tmp_path / "out"), dtype="bfloat16")
  back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"))
  w = back.model.embed_tokens.weight
  assert w.dtype == torch.bfloat16
  torch.testing.assert_close(w.float(), m.model.embed_tokens.weight.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_unsupported_checkpoints_are_refused(tmp_path):
  base = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4)
  with pytest.raises(hf.HFError, match="'llama3' lacks 'low_freq_factor'"):
    hf.model_config_from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
  bad_bands = {**LLAMA3_ROPE, "low_freq_factor": 4.0}
  with pytest.raises(hf.HFError, match="rope_low_freq_factor < rope_high_freq_factor"):
    hf.model_config_from_hf({**base, "rope_scaling": bad_bands})
  with pytest.raises(hf.HFError, match="RoPE scaling 'yarn'"):
    hf.model_config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
  with pytest.raises(hf.HFError, match="attention_bias=true: .* o_proj bias"):
    hf.model_config_from_hf({**base, "attention_bias": True})
  with pytest.raises(hf.HFError, match="model_type='mistral'"):
    hf.model_config_from_hf({**base, "model_type": "mistral"})
  with pytest.raises(hf.HFError, match="use_sliding_window=true"):
    hf.model_config_from_hf({**base, "model_type": "qwen2", "use_sliding_window": True})
  # What HF's Llama / Qwen2 cannot represent is refused on export, before anything is written.
  with pytest.raises(hf.HFError, match="model.mlp='gelu'"):
    hf.save({}, dataclasses.replace(hf.model_config_from_hf(base), mlp="gelu"), str(tmp_path / "gelu"))
  assert not (tmp_path / "gelu").exists()
  # A tensor the model has no slot for must not be dropped silently.
  m = _hf_model("gqa_untied")
  m.save_pretrained(tmp_path / "hf")
  from safetensors.numpy import load_file, save_file
  f = tmp_path / "hf" / hf.SINGLE_FILE
  arrays = load_file(str(f))
  arrays["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
  save_file(arrays, str(f), metadata={"format": "pt"})
  with pytest.raises(hf.HFError, match="q_proj.bias"):
    hf.load(str(tmp_path / "hf"))
  with pytest.raises(hf.HFError, match="no config.json"):
    hf.load(str(tmp_path))


def test_workdir_import_export_cli_round_trip(tmp_path, capsys):
  """HF dir -> step-0 orbax checkpoint (CLI) -> HF dir (CLI): identical tensors."""
  m = _hf_model("gqa_untied", seed=8)
  m.save_pretrained(tmp_path / "hf")
  wd, out = tmp_path / "wd", tmp_path / "out"
  spec = "experiments/configs/quickstart.py:runlocal=True"
  # The quickstart layout has tensor=4, which 2 KV heads cannot split: refused before anything is written.
  assert hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--workdir", str(wd), "--config", spec]) == 2
  assert "pick a tensor axis that divides 2" in capsys.readouterr().err and not wd.exists()
  assert hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--workdir", str(wd), "--config", spec,
                  "--config.mesh.data=4", "--config.mesh.tensor=2"]) == 0
  printed = capsys.readouterr().out
  assert "--config.mesh.tensor=2" in printed and "--config.model.n_kv_heads=2" in printed
  assert (wd / "config.json").exists()
  # Importing twice into the same workdir would mix runs: refused.
  assert hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--workdir", str(wd)]) == 2
  assert hf.main(["export", "--workdir", str(wd), "--out", str(out)]) == 0
  back = transformers.LlamaForCausalLM.from_pretrained(str(out))
  for k, v in m.state_dict().items():
    assert torch.equal(v, back.state_dict()[k]), k


def test_imported_checkpoint_is_what_training_resumes(tmp_path):
  """The import's step-0 state has exactly the structure the training loop restores (same optimizer)."""
  from framework import checkpoint as ckpt_lib
  from parallelism.step import build_on_devices
  m = _hf_model("mha_tied", seed=9)
  m.save_pretrained(tmp_path / "hf")
  cfg = dataclasses.replace(Config(), optim=OptimConfig(warmup_steps=2), train=TrainConfig(steps=4))
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=16, global_batch=8),
                            mesh=MeshConfig(data=2, tensor=4))  # restores into a sharded layout
  cfg = hf.import_to_workdir(str(tmp_path / "hf"), str(tmp_path / "wd"), cfg)
  from framework import config as config_lib
  cfg = config_lib.validate(cfg, jax.device_count())
  step = build_on_devices(cfg)
  ck = ckpt_lib.Checkpointer(str(tmp_path / "wd"), cfg.checkpoint)
  state, data_state = ck.restore(step.abstract_state())
  ck.close()
  assert int(state.step) == 0 and data_state["step"] == 0
  toks = _tokens(seed=10)
  np.testing.assert_allclose(_our_logits(cfg.model, jax.device_get(state.params), toks), _hf_logits(m, toks),
                             rtol=0, atol=1e-4)


# ---------------------------------------------------------------- Mixtral (mixture of experts)

MIXTRAL_CASES = {
    # name: (config kwargs, scan_layers)
    "mixtral_gqa_untied": (dict(num_key_value_heads=2, tie_word_embeddings=False), True),
    "mixtral_tied_unrolled_llama3_rope": (dict(num_key_value_heads=1, tie_word_embeddings=True,
                                               rope_scaling=LLAMA3_ROPE), False),
}


def _mixtral(case, seed=0):
  kw, _ = MIXTRAL_CASES[case]
  cfg = transformers.MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_local_experts=4, num_experts_per_tok=2,
                                   max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
                                   sliding_window=None, attn_implementation="eager", **kw)
  torch.manual_seed(seed)
  m = transformers.MixtralForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in m.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
  return m


@pytest.mark.parametrize("case", sorted(MIXTRAL_CASES))
def test_mixtral_logits_match_transformers_and_export_round_trips(case, tmp_path):
  kw, scan = MIXTRAL_CASES[case]
  m = _mixtral(case)
  m.save_pretrained(tmp_path / "hf")
  cfg, params = hf.load(str(tmp_path / "hf"), scan_layers=scan)
  assert (cfg.n_experts, cfg.experts_per_token, cfg.moe_d_ff, cfg.n_shared_experts) == (4, 2, 48, 0)
  assert cfg.router == "softmax" and cfg.moe_norm_topk and cfg.router_scale == 1.0
  assert cfg.aux_loss_coef == pytest.approx(2 * m.config.router_aux_loss_coef)
  tree = params["layers"] if scan else params["layers_0"]
  assert "mlp" not in tree and set(tree["moe"]) == {"router", "we_gate", "we_up", "we_down"}
  assert cfg.n_params() == sum(p.numel() for p in m.parameters())
  toks = _tokens()
  ref, got = _hf_logits(m, toks), _our_logits(cfg, params, toks)
  assert np.abs(ref).max() > 1.0
  np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
  # The routing is exercised: a different top-k (k=1) on the same weights is far off.
  k1 = _our_logits(dataclasses.replace(cfg, experts_per_token=1), params, toks)
  assert np.abs(k1 - ref).max() > 1e-2
  hf.save(params, cfg, str(tmp_path / "out"))
  hf_cfg = json.loads((tmp_path / "out" / hf.CONFIG_FILE).read_text())
  assert hf_cfg["model_type"] == "mixtral" and hf_cfg["architectures"] == ["MixtralForCausalLM"]
  assert (hf_cfg["num_local_experts"], hf_cfg["num_experts_per_tok"], hf_cfg["intermediate_size"]) == (4, 2, 48)
  assert hf_cfg["router_aux_loss_coef"] == pytest.approx(m.config.router_aux_loss_coef)
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
  assert type(back) is type(m)
  ref_sd, got_sd = m.state_dict(), back.state_dict()
  assert set(ref_sd) == set(got_sd)
  for k in ref_sd:
    assert torch.equal(ref_sd[k], got_sd[k]), k
  np.testing.assert_allclose(_hf_logits(back, toks), ref, rtol=0, atol=0)


def test_framework_moe_params_round_trip_exactly(tmp_path):
  """A MoE model initialised by the framework -> HF Mixtral directory -> back: the same arrays, bit for bit."""
  from framework.config import ModelConfig
  cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, experts_per_token=2,
                    moe_d_ff=32, max_seq_len=32)
  params = jax.device_get(model_lib.init_params(model_lib.build(cfg), jax.random.key(0)))
  from flax.core import meta
  params = meta.unbox(params)
  hf.save(params, cfg, str(tmp_path / "out"))
  cfg2, back = hf.load(str(tmp_path / "out"))
  for f in ("n_experts", "experts_per_token", "moe_d_ff", "router", "moe_norm_topk", "aux_loss_coef", "d_model"):
    assert getattr(cfg2, f) == pytest.approx(getattr(cfg, f)), f
  flat, flat2 = jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves_with_path(back)
  assert [p for p, _ in flat] == [p for p, _ in flat2]
  for (path, a), (_, b) in zip(flat, flat2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  toks = _tokens()[:, :8] % 96
  np.testing.assert_array_equal(_our_logits(cfg, params, toks), _our_logits(cfg2, back, toks))


@pytest.mark.parametrize("kw,match", [
    (dict(n_shared_experts=1), "model.n_shared_experts=1: .*train with model.n_shared_experts=0"),
    (dict(router="sigmoid"), "model.router='sigmoid'"),
    (dict(router_scale=2.5), "model.router_scale=2.5"),
    (dict(router_bias_rate=0.001), "router_bias_rate=0.001"),
    (dict(moe_norm_topk=False), "moe_norm_topk=False"),
    (dict(qkv_bias=True), "qkv_bias=True"),
])
def test_moe_that_mixtral_cannot_express_is_refused(kw, match, tmp_path):
  from framework.config import ModelConfig
  cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=1, n_heads=4, n_experts=4, moe_d_ff=32, **kw)
  with pytest.raises(hf.HFError, match=match) as e:
    hf.save({}, cfg, str(tmp_path / "bad"))
  assert "\n" not in str(e.value) and not (tmp_path / "bad").exists()


def test_mixtral_sliding_window_is_refused():
  base = dict(model_type="mixtral", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_local_experts=4, num_experts_per_tok=2)
  assert hf.model_config_from_hf({**base, "sliding_window": None}).n_experts == 4
  with pytest.raises(hf.HFError, match="sliding_window=4096"):
    hf.model_config_from_hf({**base, "sliding_window": 4096})


def test_mixtral_workdir_import_export_cli_round_trip(tmp_path, capsys):
  """Mixtral dir -> step-0 training checkpoint (CLI) -> Mixtral dir (CLI): identical tensors."""
  m = _mixtral("mixtral_gqa_untied", seed=11)
  m.save_pretrained(tmp_path / "hf")
  wd, out = tmp_path / "wd", tmp_path / "out"
  assert hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--workdir", str(wd)]) == 0
  printed = capsys.readouterr().out
  assert "--config.model.n_experts=4" in printed and "--config.model.moe_d_ff=48" in printed
  assert hf.main(["export", "--workdir", str(wd), "--out", str(out)]) == 0
  back = transformers.MixtralForCausalLM.from_pretrained(str(out))
  for k, v in m.state_dict().items():
    assert torch.equal(v, back.state_dict()[k]), k
