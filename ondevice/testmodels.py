"""Hub-like models made here, with no downloads: tokenizers trained on the Python standard library's source, and
small random Hugging Face checkpoints (Llama 3.1, Qwen2, Qwen3, Mistral shapes) written through ``transformers``.

    vocab_dir = train_tokenizer(dir, kind="llama3")       # tokenizer.json + tokenizer_config.json (chat template)
    hf_checkpoint(dir, "qwen2", vocab_size=512)            # config.json + model.safetensors (+ copy the tokenizer)

``kind``: "llama3" / "qwen2" (byte-level BPE with that family's pre-tokenizer regex and special tokens),
"gpt2" (byte-level BPE, GPT-2's regex), "spm" (Metaspace + byte-fallback BPE, Llama 2 / Mistral style).
The tests and benchmarks use them (tests/ondevice/test_hub.py, test_serve.py).

Random mixture-of-experts GGUFs in llama.cpp's MoE layout (``moe_gguf``): a Qwen3-MoE shape (arch ``qwen3moe``:
per-head q/k norms, NEOX RoPE, ``expert_feed_forward_length``) or a Mixtral shape (arch ``llama`` with experts),
byte vocabulary, any ``gguf_io.QUANTS`` type (tests/ondevice/test_moe.py, ``python -m ondevice.bench --suite moe``).

    moe_gguf("/tmp/q3moe.gguf", "qwen3moe", quant="q8_0", n_layers=2, d_model=128, n_expert=8, n_used=2, ff=128)
"""
from __future__ import annotations

import json
import pathlib
import sysconfig

from ondevice.hf_gguf import _PRE_REGEX

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
SPECIALS = {"llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>"],
            "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "gpt2": ["<|endoftext|>"],
            "spm": ["<unk>", "<s>", "</s>"]}


def stdlib_corpus(max_bytes: int = 2 << 20) -> str:
  """Source text of Python standard library modules (sorted, so the same on every machine with this Python)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  out, n = [], 0
  for f in sorted(root.glob("*.py")):
    t = f.read_text(encoding="utf-8", errors="replace")
    out.append(t)
    n += len(t)
    if n >= max_bytes:
      break
  return "".join(out)[:max_bytes]


def train_tokenizer(out_dir: str, kind: str = "llama3", vocab_size: int = 512, corpus: str = None) -> str:
  """Trains a tokenizer of ``kind`` on ``corpus`` (default: the stdlib) and writes it as HF files."""
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
  corpus = corpus if corpus is not None else stdlib_corpus()
  specials = SPECIALS[kind]
  if kind == "spm":
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials + alphabet, show_progress=False)
  else:
    tok = Tokenizer(models.BPE())
    if kind == "gpt2":
      tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
      rx = next(r for r, name in _PRE_REGEX.items() if name == ("llama-bpe" if kind == "llama3" else kind))
      tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(rx), "isolated"),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  lines = corpus.splitlines(keepends=True)
  tok.train_from_iterator([("".join(lines[i:i + 64])) for i in range(0, len(lines), 64)], trainer)
  d = pathlib.Path(out_dir)
  d.mkdir(parents=True, exist_ok=True)
  tok.save(str(d / "tokenizer.json"))
  cfg = {"llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3_CHAT),
         "qwen2": dict(bos_token=None, eos_token="<|im_end|>", chat_template=CHATML, add_bos_token=False),
         "gpt2": dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", add_bos_token=False),
         "spm": dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", add_bos_token=True)}[kind]
  (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, tokenizer_class="PreTrainedTokenizerFast"),
                                                      indent=1))
  return str(d)


MOE_KINDS = {"qwen3moe": "qwen3moe", "mixtral": "llama"}  # shape -> GGUF architecture


def moe_gguf(path: str, kind: str = "qwen3moe", quant: str = "q8_0", n_layers: int = 2, d_model: int = 128,
             n_heads: int = 4, n_kv_heads: int = 2, n_expert: int = 8, n_used: int = 2, ff: int = 128,
             vocab_size: int = 256, max_len: int = 256, seed: int = 0, std: float = 0.2) -> dict:
  """A random-weight MoE GGUF of ``kind`` (qwen3moe or mixtral) written by ``gguf_io.write_quantized``; std 0.2
  (peaked logits, as ``gguf_io.random_arrays``). Returns the writer's summary."""
  from ondevice import gguf_check, gguf_io
  if kind not in MOE_KINDS:
    raise ValueError(f"MoE shape {kind!r}: choose {' or '.join(MOE_KINDS)}")
  arch = MOE_KINDS[kind]
  cfg = gguf_io.tiny_config(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                            n_kv_heads=n_kv_heads, d_ff=ff, max_seq_len=max_len, init_std=std)
  moe = gguf_check.MoE(n_expert, n_used, ff)
  arrays = gguf_io.random_arrays(cfg, seed=seed, std=std, arch=arch, moe=moe)
  return gguf_io.write_quantized(arrays, cfg, path, quant, name=f"random-{kind}", arch=arch, moe=moe)


def hf_checkpoint(out_dir: str, arch: str = "llama3", vocab_size: int = 512, d_model: int = 256, n_layers: int = 2,
                  n_heads: int = 4, n_kv_heads: int = 2, d_ff: int = 768, max_len: int = 256, seed: int = 0,
                  std: float = 0.02, tokenizer_dir: str = None) -> str:
  """A random ``transformers`` model of ``arch`` (llama3: Llama 3.1 RoPE scaling; qwen2; qwen3; qwen3moe; mistral) saved
  with save_pretrained (float32 safetensors); the tokenizer files of ``tokenizer_dir`` are copied beside it."""
  import torch
  import transformers as tf
  common = dict(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                num_key_value_heads=n_kv_heads, intermediate_size=d_ff, max_position_embeddings=max_len,
                rms_norm_eps=1e-5, initializer_range=std, tie_word_embeddings=False)
  if arch == "llama3":
    cfg = tf.LlamaConfig(**common, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
  elif arch == "qwen2":
    cfg = tf.Qwen2Config(**common, rope_theta=1000000.0)
  elif arch == "qwen3":
    cfg = tf.Qwen3Config(**common, rope_theta=1000000.0, head_dim=d_model // n_heads)
  elif arch == "mistral":
    cfg = tf.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
  elif arch == "qwen3moe":  # 8 experts of width 256 (K-quant rows), top-2, renormalised (as Qwen3-30B-A3B)
    cfg = tf.Qwen3MoeConfig(**common, rope_theta=1000000.0, head_dim=d_model // n_heads, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)
  else:
    raise ValueError(f"arch {arch!r}: choose llama3, qwen2, qwen3, qwen3moe or mistral")
  torch.manual_seed(seed)
  model = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
  with torch.no_grad():  # norms near 1 and biases non-zero, so that every parameter matters
    for n, p in model.named_parameters():
      if n.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif n.endswith(".bias"):
        p.copy_(0.1 * torch.randn_like(p))
  d = pathlib.Path(out_dir)
  model.save_pretrained(str(d), safe_serialization=True)
  if tokenizer_dir:
    for f in ("tokenizer.json", "tokenizer_config.json"):
      src = pathlib.Path(tokenizer_dir) / f
      if src.exists():
        (d / f).write_bytes(src.read_bytes())
  return str(d)
