"""`ondevice.export` of a mixture-of-experts training workdir (framework/moe.py): llama.cpp's Mixtral layout (arch
llama with experts, names from framework/names.py), the framework's logits on the f32 file (max |diff| ~1e-5 on
logits ~7), and the same greedy tokens and bit-identical logits as llama.cpp on f32 and q8_0 files."""
import dataclasses
import re

import jax
import numpy as np
import pytest

from framework import hf as fhf
from framework import model as fm
from framework.config import ModelConfig
from ondevice import export, gguf_check, gguf_io
from ondevice.weights import MappedGGUF

from .conftest import llama_cpp_peer
from .test_export_workdir import _write_workdir

PROMPT = list(b"import os\nimport sys\n\ndef main(argv):\n  ")
N = 16
# init_std 0.2: peaked logits (greedy comparisons are meaningful); 8 experts, top-2, width 64 (q8_0 rows: 64 % 32)
MOE = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128, init_std=0.2,
                  n_experts=8, experts_per_token=2, moe_d_ff=64, router="softmax", moe_norm_topk=True)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
  """A workdir holding a random-init MoE checkpoint (as a training run leaves it), exported f32 and q8_0 by the CLI;
  and the framework's logits on PROMPT."""
  d = tmp_path_factory.mktemp("moe_export")
  with jax.numpy_rank_promotion("allow"):
    model = fm.build(MOE)
    params = fm.init_params(model, jax.random.key(4))
    logits = np.asarray(model.apply({"params": params}, jax.numpy.asarray([PROMPT])))[0]
  wd = str(d / "wd")
  _write_workdir(wd, MOE, params, step=2)
  files = {}
  for q in ("f32", "q8_0"):
    files[q] = str(d / f"moe-{q}.gguf")
    assert export.main(["--workdir", wd, "--out", files[q], "--quant", q]) == 0
  hf_dir = str(d / "hf")  # the same weights as a HF MixtralForCausalLM directory, converted by --hf-dir
  fhf.save(params, MOE, hf_dir)
  files["hf_f32"] = str(d / "moe-hf-f32.gguf")
  assert export.main(["--hf-dir", hf_dir, "--out", files["hf_f32"], "--quant", "f32", "--byte-vocab"]) == 0
  return files, logits


def test_hf_mixtral_directory_converts_to_the_same_file(moe_run):
  """A HF Mixtral checkpoint directory -> GGUF gives the tensors the workdir export writes, bit for bit."""
  from gguf import GGUFReader
  files, _ = moe_run
  a, b = GGUFReader(files["f32"]), GGUFReader(files["hf_f32"])
  ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
  assert sorted(ta) == sorted(tb) and any(n.endswith("ffn_down_exps.weight") for n in ta)
  for n, t in ta.items():
    assert t.tensor_type == tb[n].tensor_type and np.array_equal(np.asarray(t.data), np.asarray(tb[n].data)), n
  assert gguf_io.read_info(files["hf_f32"]).moe == gguf_check.MoE(8, 2, 64)


def test_mixtral_layout_and_metadata(moe_run):
  from gguf import GGUFReader
  files, _ = moe_run
  info = gguf_io.read_info(files["q8_0"])
  assert info.arch == "llama" and info.moe == gguf_check.MoE(8, 2, 64) and not info.rope_neox
  r = GGUFReader(files["q8_0"])
  t = {x.name: x for x in r.tensors}
  assert [int(v) for v in t["blk.1.ffn_gate_inp.weight"].shape] == [64, 8]  # ggml ne {n_embd, n_expert}
  assert t["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"
  for n in ("gate", "up", "down"):  # {n_in, n_out, n_expert}; D = F = 64 here
    assert [int(v) for v in t[f"blk.1.ffn_{n}_exps.weight"].shape] == [64, 64, 8]
    assert t[f"blk.1.ffn_{n}_exps.weight"].tensor_type.name == "Q8_0"
  assert "blk.0.ffn_gate.weight" not in t and "blk.0.ffn_up.weight" not in t
  assert int(r.fields["llama.feed_forward_length"].parts[-1][0]) == 64
  assert int(r.fields["llama.expert_count"].parts[-1][0]) == 8
  assert int(r.fields["llama.expert_used_count"].parts[-1][0]) == 2


def test_f32_file_has_the_framework_logits(moe_run):
  """Our engine on the f32 file computes the training model's logits: every name, layout and the routing map."""
  from ondevice.forward import GGUFLlama
  files, ref = moe_run
  m = GGUFLlama(MappedGGUF(files["f32"]), max_len=128)
  got = m.forward(PROMPT, 0, m.new_cache())
  assert np.abs(ref).max() > 1.0
  assert np.abs(got - ref).max() <= 1e-4 * float(np.abs(ref).max())
  assert (m.experts.counts > 0).sum(axis=1).min() > 2  # the prompt was routed to several experts per layer


@pytest.mark.parametrize("q", ["f32", "q8_0"])
def test_same_greedy_tokens_and_logits_as_llama_cpp(moe_run, q):
  from ondevice.forward import GGUFLlama
  files, _ = moe_run
  llm = llama_cpp_peer().Llama(files[q], n_ctx=128, n_threads=1, n_threads_batch=1, type_k=0, type_v=0,
                               flash_attn=False, logits_all=True, verbose=False)
  m = GGUFLlama(MappedGGUF(files[q]), max_len=128)
  c = m.new_cache()
  ours = m.forward(PROMPT, 0, c)
  llm.eval(PROMPT)
  np.testing.assert_array_equal(ours, llm.scores[:len(PROMPT)], err_msg="prefill logits")  # bit-exact, as test_moe
  a, b, toks = ours[-1], llm.scores[len(PROMPT) - 1], []
  for i in range(N):
    ta, tb = int(np.argmax(a)), int(np.argmax(b))
    assert ta == tb, f"greedy streams diverge at token {i} ({toks})"
    np.testing.assert_array_equal(a, b, err_msg=f"logits at token {i}")
    toks.append(ta)
    a = m.forward([ta], len(PROMPT) + i, c)[-1]
    llm.eval([ta])
    b = llm.scores[llm.n_tokens - 1]
  assert len(set(toks)) > 3  # a stream, not one repeated token


@pytest.mark.parametrize("override,match", [
    ("--config.model.n_shared_experts=1", "model.n_shared_experts=1: .*train with model.n_shared_experts=0"),
    ("--config.model.router=sigmoid", "model.router='sigmoid'"),
    ("--config.model.router_scale=2.5", "model.router_scale=2.5"),
])
def test_what_mixtral_cannot_express_is_refused(tmp_path, capsys, override, match):
  out = tmp_path / "x.gguf"
  args = ["--random", "--config", "experiments/configs/moe_quickstart.py:runlocal=True", "--out", str(out),
          "--config.model.n_shared_experts=0", override]
  assert export.main(args) == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and err.startswith("error: ")
  assert re.search(match, err), err
  assert not out.exists()


def test_random_moe_config_exports(tmp_path, capsys):
  """--random with a MoE experiment config (shared expert switched off): a Mixtral file our engine runs."""
  from ondevice.forward import GGUFLlama
  out = str(tmp_path / "r.gguf")
  assert export.main(["--random", "--config", "experiments/configs/moe_quickstart.py:runlocal=True", "--out", out,
                      "--quant", "q8_0", "--config.model.n_shared_experts=0"]) == 0
  info = gguf_io.read_info(out)
  assert info.moe == gguf_check.MoE(8, 2, 64) and dataclasses.asdict(info.cfg)["n_experts"] == 8
  m = GGUFLlama(MappedGGUF(out), max_len=64)
  assert np.isfinite(m.forward(PROMPT[:8], 0, m.new_cache())).all()


@pytest.mark.parametrize("with_prismllm_config", [True, False])
def test_loaded_back_into_the_framework_gives_its_logits(moe_run, monkeypatch, with_prismllm_config):
  """gguf_io.load_params of the Mixtral file: the framework's MoE model again, with the original logits; without
  the file's prismllm.model_config (a llama.cpp-converted file) the routing is Mixtral's from the llama.* keys."""
  files, logits = moe_run
  if not with_prismllm_config:
    field = gguf_io._field
    monkeypatch.setattr(gguf_io, "_field", lambda r, k, *d: None if k == "prismllm.model_config" else field(r, k, *d))
  params, cfg = gguf_io.load_params(files["f32"])
  assert (cfg.n_experts, cfg.experts_per_token, cfg.moe_d_ff, cfg.router, cfg.moe_norm_topk) == \
      (8, 2, 64, "softmax", True)
  with jax.numpy_rank_promotion("allow"):
    got = np.asarray(fm.build(cfg).apply({"params": params}, jax.numpy.asarray([PROMPT])))[0]
  np.testing.assert_allclose(got, logits, rtol=0, atol=1e-4)
