"""HF round trip through the framework: a Llama-3.1-shaped (rope_scaling 'llama3') and a Qwen2-shaped random
checkpoint written by transformers (ondevice/testmodels.py, no downloads) are imported by framework/hf.py (logits
within 1e-4 of transformers), exported to GGUF from the framework params (ondevice/gguf_io.export_gguf: llama with
rope_freqs.weight, qwen2 with its q/k/v biases), and run on the device engine: greedy tokens equal llama.cpp's
(llama-cpp-python, exact configuration: f32 KV cache, no flash attention) on the same file."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework import hf
from framework import model as model_lib
from ondevice import gguf_io, testmodels

from .conftest import llama_cpp_peer

torch = pytest.importorskip("torch", reason="torch not installed: HF interop tests need torch (CPU build is fine)")
pytest.importorskip("transformers", reason="transformers not installed: pip install transformers")

ARCHS = ("llama3", "qwen2")
# token ids of the byte vocabulary the GGUF export writes (vocab 512 >= 256)
PROMPT = list(b"import os\nimport sys\n\n\ndef main(argv):\n    ")
N_NEW = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """arch -> (HF dir, transformers logits of PROMPT, imported (cfg, params)). std 0.1 (not 0.02): logits of a few
  units, so that 1e-4 is a real bar and greedy tokens are decided by clear margins."""
  import transformers as tf
  d = tmp_path_factory.mktemp("hfrt")
  out = {}
  for arch in ARCHS:
    path = testmodels.hf_checkpoint(str(d / arch), arch, vocab_size=512, d_model=128, n_layers=2, n_heads=4,
                                    n_kv_heads=2, d_ff=256, max_len=128, seed=3, std=0.1)
    ref = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
      want = ref.eval()(torch.tensor([PROMPT])).logits[0].numpy()
    out[arch] = (path, want, hf.load(path))
  return out


def _our_logits(cfg, params, ids):
  model = model_lib.build(cfg)
  return np.asarray(model.apply({"params": jax.tree.map(jnp.asarray, params)}, jnp.asarray([ids])))[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_import_logits_match_transformers(checkpoints, arch):
  _, want, (cfg, params) = checkpoints[arch]
  assert cfg.rope_scaling == ("llama3" if arch == "llama3" else "none") and cfg.qkv_bias == (arch == "qwen2")
  got = _our_logits(cfg, params, PROMPT)
  assert np.abs(want).max() > 1.0  # logits of a few units: 1e-4 is a real bar
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_export_runs_on_device_like_llama_cpp(checkpoints, arch, tmp_path):
  from ondevice import generate, run
  from ondevice.forward import GGUFLlama
  from ondevice.weights import MappedGGUF
  _, want, (cfg, params) = checkpoints[arch]
  path = str(tmp_path / f"{arch}.gguf")
  gguf_io.export_gguf(params, cfg, path, "f32", name=arch)
  info = gguf_io.read_info(path)
  assert info.arch == ("qwen2" if arch == "qwen2" else "llama") and not info.unsupported
  assert ("rope_freqs.weight" in info.tensors) == (arch == "llama3")
  assert ("blk.0.attn_q.bias" in info.tensors) == (arch == "qwen2")
  # The file reads back as the same framework model (q/k rows un-permuted for llama, left alone for qwen2).
  back, back_cfg = gguf_io.load_params(path)
  assert back_cfg == cfg
  jax.tree.map(np.testing.assert_array_equal, back, params)
  # The device engine computes transformers' function from the file ...
  m = GGUFLlama(MappedGGUF(path), max_len=128)
  np.testing.assert_allclose(m.forward(PROMPT, 0, m.new_cache()), want, rtol=0, atol=1e-4)
  # ... and generates llama.cpp's greedy tokens.
  llm = llama_cpp_peer().Llama(path, n_ctx=128, n_threads=1, n_threads_batch=1, type_k=0, type_v=0,
                               flash_attn=False, verbose=False)
  theirs = []
  for t in llm.generate(PROMPT, temp=0.0):
    theirs.append(int(t))
    if len(theirs) == N_NEW:
      break
  eng, _ = run.build_engine(path, ctx=128)
  try:
    ours = generate.greedy(eng, PROMPT, N_NEW).tokens
  finally:
    eng.close()
  assert ours == theirs
  assert len(set(ours)) > 3, ours  # not a degenerate stream that any rope or bias would produce


@pytest.mark.parametrize("arch", ARCHS)
def test_imported_workdir_exports_to_gguf(checkpoints, arch, tmp_path):
  """`framework.hf import` -> workdir -> `ondevice.export --workdir`: the trained-model path keeps the rope
  scaling and the biases."""
  from ondevice import export
  path, _, (cfg, params) = checkpoints[arch]
  hf.import_to_workdir(path, str(tmp_path / "wd"))
  out = str(tmp_path / "m.gguf")
  assert export.main(["--workdir", str(tmp_path / "wd"), "--out", out]) == 0
  info = gguf_io.read_info(out)
  assert info.arch == ("qwen2" if arch == "qwen2" else "llama")
  assert ("rope_freqs.weight" in info.tensors) == (arch == "llama3")
  back, back_cfg = gguf_io.load_params(out)
  assert dataclasses.replace(back_cfg, max_seq_len=cfg.max_seq_len, init_std=cfg.init_std) == cfg
  jax.tree.map(np.testing.assert_array_equal, back, params)
