"""Hub-like files made here, against llama.cpp (llama-cpp-python, exact configuration: f32 KV cache, no flash
attention): K-quant files from llama.cpp's quantiser, random Llama-3.1 / Qwen2 / Qwen3 / Mistral checkpoints
written by transformers and converted with their trained tokenizers. Logits must be equal bit for bit, greedy
streams equal, tokenization and chat prompts equal; the F32 conversion must match transformers."""
import numpy as np
import pytest

from ondevice import gguf_io, planes, testmodels
from ondevice.forward import GGUFLlama
from ondevice.weights import MappedGGUF

from .conftest import llama_cpp_peer

PROMPT = list(b"import os\nimport sys\n\n\ndef main(argv):\n    ")
TEXTS = ["def hello(x):\n  return x", "h\u00e9llo w\u00f6rld \u2211 \U0001F600  tabs\tand  spaces", " leading",
         "a\u2581b", "  \n\n  x = [1, 2, 3]  # 123456789", "<|im_start|>user\nhi<|im_end|>\n", "<s>text</s>", ""]


def _llama(path, threads=1, **kw):
  return llama_cpp_peer().Llama(path, n_ctx=256, n_threads=threads, n_threads_batch=threads, type_k=0, type_v=0,
                                flash_attn=False, verbose=False, **kw)


def _same_stream(path, prompt, n=32, threads=1):
  """Prefill logits (all rows) and n greedy steps: ours == llama.cpp's, bit for bit. Returns the top-2 margins."""
  llm = _llama(path, threads, logits_all=True)
  planes.set_threads(threads)
  try:
    m = GGUFLlama(MappedGGUF(path), max_len=256)
    c = m.new_cache()
    ours = m.forward(prompt, 0, c)
    llm.eval(prompt)
    np.testing.assert_array_equal(ours, llm.scores[:len(prompt)], err_msg="prefill logits")
    a, margins = ours[-1], []
    for i in range(n):
      b = llm.scores[llm.n_tokens - 1]
      np.testing.assert_array_equal(a, b, err_msg=f"logits at step {i}")
      top = np.sort(b)[-2:]
      margins.append(float(top[1] - top[0]))
      t = int(np.argmax(a))
      a = m.forward([t], len(prompt) + i, c)[-1]
      llm.eval([t])
    return margins
  finally:
    planes.set_threads(1)


@pytest.fixture(scope="module")
def kquant_files(tmp_path_factory):
  """Our random model (flat logits, std 0.02) as F16, then llama.cpp's quantiser: Q4_K_M, Q5_K_M, Q6_K."""
  llama_cpp_peer()
  d = tmp_path_factory.mktemp("kq")
  cfg = gguf_io.tiny_config(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768, max_seq_len=256,
                            init_std=0.02)
  arrays = gguf_io.random_arrays(cfg, seed=5, std=0.02)
  out = {}
  for q in ("q4_k_m", "q5_k_m", "q6_k"):
    out[q] = str(d / f"m-{q}.gguf")
    gguf_io.write_quantized(arrays, cfg, out[q], q)
  return out


@pytest.mark.parametrize("q", ["q4_k_m", "q6_k", "q5_k_m"])
def test_k_quant_files_equal_llama_cpp(kquant_files, q):
  info = gguf_io.read_info(kquant_files[q])
  types = {t.qtype for n, t in info.tensors.items() if n != "token_embd.weight"}
  want = {"q4_k_m": {"Q4_K", "Q6_K"}, "q5_k_m": {"Q5_K", "Q6_K"}, "q6_k": {"Q6_K"}}[q]
  assert want <= types, types  # the mixes really mix (Q4_K_M: Q6_K attn_v/ffn_down in some layers)
  margins = _same_stream(kquant_files[q], PROMPT)
  # meaningful only if the stream passes near-ties, where a last-bit difference would flip the argmax
  assert min(margins) < 0.02, min(margins)


def test_k_quant_two_threads_and_pass_lengths(kquant_files):
  """2 kernel threads on both sides; passes of 1..9 tokens (gemv / gemm groups of 4 / tiled >= 8 tokens)."""
  _same_stream(kquant_files["q4_k_m"], PROMPT, n=8, threads=2)
  llm = _llama(kquant_files["q5_k_m"], logits_all=True)
  m = GGUFLlama(MappedGGUF(kquant_files["q5_k_m"]), max_len=256)
  c, pos = m.new_cache(), 0
  for T in (1, 3, 4, 5, 8, 9):
    np.testing.assert_array_equal(m.forward(PROMPT[pos:pos + T], pos, c), (llm.eval(PROMPT[pos:pos + T]) or
                                  llm.scores[pos:pos + T]), err_msg=f"pass of {T}")
    pos += T


def test_generation_equals_llama_cpp_generate(kquant_files):
  """llama.cpp's own generate (logits of the last token only: its last feed-forward block then runs one row)
  and ours (generate.greedy, last_only) give the same tokens on a Q4_K_M file from a text prompt."""
  from ondevice import generate, run, vocab
  path = kquant_files["q4_k_m"]
  llm = _llama(path)
  ids = llm.tokenize(b"def main(argv):\n    return [x for x in argv]\n", add_bos=True)
  assert ids == vocab.load(path).encode("def main(argv):\n    return [x for x in argv]\n")
  theirs = []
  for t in llm.generate(ids, temp=0.0):
    theirs.append(t)
    if len(theirs) == 24:
      break
  eng, _ = run.build_engine(path, ctx=256)
  try:
    assert generate.greedy(eng, ids, 24).tokens == theirs
  finally:
    eng.close()


@pytest.mark.parametrize("q", ["f32", "f16", "bf16"])
def test_float_files_and_head_dims_equal_llama_cpp(tmp_path, q):
  """F32 / F16 / BF16 matrices (vec_dot and tinyBLAS orders, f16/bf16 activations) and head dims 12, 20, 24, 40
  (the leftover paths of ggml's dots and RoPE), llama (NORM RoPE) and qwen2 (NEOX) graphs."""
  from ondevice import simd_k
  llama_cpp_peer()
  if q == "bf16" and not simd_k.has_bf16():
    pytest.skip("BF16 files need the AVX-512 BF16 instruction (this CPU lacks it; they are refused)")
  for i, (d, h, arch) in enumerate(((48, 4, "llama"), (80, 4, "qwen2"), (96, 4, "llama"), (160, 4, "qwen2"))):
    cfg = gguf_io.tiny_config(d_model=d, n_layers=2, n_heads=h, n_kv_heads=2, d_ff=160, max_seq_len=256,
                              init_std=0.02)
    path = str(tmp_path / f"m{i}-{q}.gguf")
    gguf_io.write_arrays(gguf_io.random_arrays(cfg, seed=i, std=0.02, arch=arch), cfg, path, q, arch=arch)
    _same_stream(path, PROMPT, n=6)


# ------------------------------------------------------------------------------------------ HF round trip

@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  d = tmp_path_factory.mktemp("hub")
  toks = {k: testmodels.train_tokenizer(str(d / f"tok-{k}"), k, 512) for k in ("llama3", "qwen2", "gpt2", "spm")}
  ck = {a: testmodels.hf_checkpoint(str(d / f"hf-{a}"), a, 512, tokenizer_dir=toks[k])
        for a, k in (("llama3", "llama3"), ("qwen2", "qwen2"), ("qwen3", "qwen2"), ("qwen3moe", "qwen2"),
                     ("mistral", "spm"))}
  return d, toks, ck


def _convert(hub, arch, q):
  from ondevice import hf_gguf
  d, _, ck = hub
  out = str(d / f"{arch}-{q}.gguf")
  hf_gguf.convert(ck[arch], out, q)
  return out


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "qwen3moe", "mistral"])
def test_hf_checkpoint_to_gguf_matches_transformers_and_llama_cpp(hub, arch):
  import torch
  import transformers as tf
  f32 = _convert(hub, arch, "f32")
  info = gguf_io.read_info(f32)
  assert info.arch == {"llama3": "llama", "mistral": "llama"}.get(arch, arch)
  assert ("rope_freqs.weight" in info.tensors) == (arch == "llama3")
  ids = [1, 5, 77, 300, 12, 9, 400, 33, 250, 3, 100, 101, 102, 7, 8, 90, 91, 92]
  ref = tf.AutoModelForCausalLM.from_pretrained(hub[2][arch], torch_dtype=torch.float32)
  with torch.no_grad():
    want = ref(torch.tensor([ids])).logits[0].numpy()
  m = GGUFLlama(MappedGGUF(f32), max_len=128)
  got = m.forward(ids, 0, m.new_cache())
  # float32 summation orders only (measured <= 8.7e-7 at a logit scale of 1.35); a wrong permutation, bias,
  # norm or RoPE factor is O(0.1)
  assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max())), np.abs(got - want).max()
  if arch == "qwen3moe":
    # llama.cpp reads the converted file as transformers' model (same tolerance); from the 15th prompt row on, its
    # expert matmuls sum in another order than ours (ulp differences), so the check is not bit for bit here
    llm = _llama(f32, logits_all=True)
    llm.eval(ids)
    assert np.abs(llm.scores[:len(ids)] - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    return
  for q in ("f32", "q8_0", "q4_k_m"):
    _same_stream(f32 if q == "f32" else _convert(hub, arch, q), ids, n=16)


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "gpt2", "spm"])
def test_tokenizers_match_llama_cpp(hub, kind):
  from ondevice import hf_gguf, vocab
  d, toks, _ = hub
  cfg = gguf_io.tiny_config(vocab_size=512, d_model=64, n_layers=1)
  path = str(d / f"vocab-{kind}.gguf")
  gguf_io.write_arrays(gguf_io.random_arrays(cfg), cfg, path, "q8_0", vocab=hf_gguf.hf_vocab(toks[kind], 512))
  v = vocab.load(path)
  llm = llama_cpp_peer().Llama(path, vocab_only=True, verbose=False)
  src = testmodels.stdlib_corpus(200_000)
  texts = TEXTS + [src[i:i + 97 + i % 300] for i in range(0, 150_000, 7919)]
  for t in texts:
    for add, special in ((True, False), (False, True)):
      assert v.encode(t, add, special) == llm.tokenize(t.encode(), add_bos=add, special=special), (t, add, special)
    ids = v.encode(t, False)
    assert v.decode(ids).encode() == llm.detokenize(ids), t
  assert len(v.encode(src[:5000], False)) < 0.7 * len(src[:5000].encode())  # a trained vocabulary merges (512: 0.55)


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_chat_prompt_matches_llama_cpp(hub, arch):
  """The file's chat template rendered (jinja2) and tokenized equals llama.cpp's own template engine's prompt,
  tokenized by llama.cpp (its built-in llama3 template leaves BOS to the tokenizer)."""
  import ctypes
  from ondevice import chat, vocab
  path = _convert(hub, arch, "q8_0")
  c = chat.Chat(vocab.load(path))
  assert c.source == "tokenizer.chat_template"
  msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "def f(x): return x  \n"},
          {"role": "assistant", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": "more"}]}]
  L = llama_cpp_peer()
  llm = L.Llama(path, vocab_only=True, verbose=False)
  flat = chat.check_messages(msgs)
  arr = (L.llama_chat_message * len(flat))(*[L.llama_chat_message(m["role"].encode(), m["content"].encode())
                                             for m in flat])
  buf = ctypes.create_string_buffer(1 << 14)
  n = L.llama_chat_apply_template(L.llama_model_chat_template(llm.model, None), arr, len(flat), True, buf, len(buf))
  theirs = llm.tokenize(buf.raw[:n], add_bos=True, special=True)
  assert c.tokens(msgs) == theirs


@pytest.mark.parametrize("key,value,match", [("norm_topk_prob", False, "norm_topk_prob=false"),
                                             ("mlp_only_layers", [0], "dense MLP layers")])
def test_qwen3_moe_that_llama_cpp_computes_otherwise_is_refused(hub, tmp_path, key, value, match):
  import json
  import shutil
  from ondevice import hf_gguf
  d = tmp_path / "ck"
  shutil.copytree(hub[2]["qwen3moe"], d)
  cfg = json.loads((d / "config.json").read_text())
  (d / "config.json").write_text(json.dumps(dict(cfg, **{key: value})))
  with pytest.raises(hf_gguf.HFGGUFError, match=match):
    hf_gguf.convert(str(d), str(tmp_path / "x.gguf"))
  assert not (tmp_path / "x.gguf").exists()
