"""Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) -> GGUF, as llama.cpp reads it.

Architectures: LlamaForCausalLM (incl. Llama 3.x RoPE scaling, written as rope_freqs.weight the way llama.cpp's
converter computes it, and attention biases), MistralForCausalLM (a llama file), Qwen2ForCausalLM (q/k/v biases;
NEOX RoPE, so q/k rows are not permuted), Qwen3ForCausalLM (per-head q/k RMSNorm). Tensor names and the q/k row
permutation come from framework/names.py (TABLE and EXTRA). The tokenizer: a byte-level BPE tokenizer.json whose
pre-tokenizer llama.cpp knows (GPT-2, Llama 3, Qwen2 regexes) becomes a gpt2 vocabulary with its merges; a
Metaspace + byte-fallback BPE (Llama 2 / Mistral style) becomes an SPM vocabulary (score = -id). Special added
tokens are CONTROL, others USER_DEFINED. tokenizer_config.json gives bos/eos, add_bos and the chat template.
Qwen3MoeForCausalLM: a qwen3moe file, the per-expert tensors stacked (framework/names.py
QWEN3_MOE); refused when llama.cpp computes it otherwise (norm_topk_prob false, dense layers between the MoE
layers). MixtralForCausalLM (a mixture of experts) is read by framework/hf.py and written in llama.cpp's Mixtral
layout (ondevice.gguf_io.export_moe_gguf: arch llama with experts, ffn_gate_inp + stacked ffn_{gate,up,down}_exps);
it is held in memory as float32 while it is written (4 bytes per parameter). Anything else is refused in one line
naming the key.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Optional

import numpy as np

from framework import hf as fhf
from framework import names, rope
from ondevice import gguf_check
from ondevice import vocab as vocab_lib
from ondevice.gguf_check import GGUFError

ARCH_OF = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
           "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe"}
# the original (tokenizer.json) regexes of the pre-tokenizers llama.cpp implements -> tokenizer.ggml.pre
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_PRE_REGEX = {_CONTRACTIONS + r"\p{N}{1,3}" + _REST: "llama-bpe", _CONTRACTIONS + r"\p{N}" + _REST: "qwen2"}


class HFGGUFError(GGUFError):
  """A checkpoint this exporter cannot write as llama.cpp runs it; the message names what differs."""


def _json(path: pathlib.Path) -> dict:
  return json.loads(path.read_text()) if path.exists() else {}


def llama3_rope_factors(head_dim: int, theta: float, p: dict) -> np.ndarray:
  """Llama 3.1's per-frequency divisors (rope_scaling rope_type 'llama3') as rope_freqs.weight: framework/rope.py
  computes them, from the HF keys (defaults: Llama 3.1's values)."""
  return rope.llama3_factors(head_dim, theta, float(p.get("factor", 8.0)), float(p.get("low_freq_factor", 1.0)),
                             float(p.get("high_freq_factor", 4.0)),
                             int(p.get("original_max_position_embeddings", 8192)))


def read_config(hf_dir: str) -> tuple:
  """config.json -> (arch, ModelConfig, rope_freqs or None)."""
  d = pathlib.Path(hf_dir)
  hf = _json(d / "config.json")
  if not hf:
    raise HFGGUFError(f"{hf_dir} has no config.json: pass the directory written by save_pretrained")
  archs = hf.get("architectures") or []
  arch = next((ARCH_OF[a] for a in archs if a in ARCH_OF), None)
  if arch is None:
    raise HFGGUFError(f"{hf_dir}: architectures={archs} is not one of {', '.join(ARCH_OF)}, MixtralForCausalLM; "
                      f"run it with llama.cpp")
  rope = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type", rope.get("type", "default"))
  params = scaling or rope
  theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
  if rope_type not in ("default", "llama3") or (rope_type == "llama3" and arch != "llama"):
    raise HFGGUFError(f"{hf_dir}: rope scaling {rope_type!r} is not implemented (default RoPE and Llama 3's "
                      f"'llama3' are); run it with llama.cpp")
  if arch == "qwen3moe":
    hf = dict(hf, intermediate_size=_qwen3_moe(hf_dir, hf).ff)  # the file's feed_forward_length: the experts'
  for key in ("mlp_bias",) + (("attention_bias",) if arch in ("qwen3", "qwen3moe") else ()):
    if hf.get(key):
      raise HFGGUFError(f"{hf_dir}: {key}=true is not implemented for {arch}; run it with llama.cpp")
  if hf.get("hidden_act", "silu") != "silu":
    raise HFGGUFError(f"{hf_dir}: hidden_act={hf['hidden_act']!r}: the runtime's MLP is SwiGLU (silu)")
  clean = dict(hf, model_type="llama", attention_bias=False, mlp_bias=False, rope_scaling=None,
               rope_parameters={"rope_type": "default", "rope_theta": theta})
  # The file's prismllm.model_config says what the framework model of these weights is (gguf_io.load_params):
  # Qwen2's q/k/v biases and Llama 3's RoPE scaling are parameters of it, Qwen3's q/k norms are not.
  cfg = dataclasses.replace(fhf.model_config_from_hf(clean), qkv_bias=arch == "qwen2")
  if rope_type == "llama3":
    factors = llama3_rope_factors(cfg.hd, theta, params)
    cfg = dataclasses.replace(cfg, rope_scaling="llama3", **{f: t(params.get(k, getattr(cfg, f)))
                                                              for k, f, t in fhf.LLAMA3_ROPE_KEYS})
    return arch, cfg, factors
  return arch, cfg, None


def _qwen3_moe(hf_dir: str, hf: dict) -> gguf_check.MoE:
  """The experts of a Qwen3MoeForCausalLM config, refusing what llama.cpp's qwen3moe does not compute: top-k
  weights not renormalised, dense MLP layers between the MoE layers."""
  if not hf.get("norm_topk_prob", False):
    raise HFGGUFError(f"{hf_dir}: norm_topk_prob=false: llama.cpp's qwen3moe renormalises the top-k routing weights; "
                      f"run it with transformers")
  if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
    raise HFGGUFError(f"{hf_dir}: dense MLP layers between the MoE layers (decoder_sparse_step / mlp_only_layers) "
                      f"are not a qwen3moe file; run it with transformers")
  n_expert = hf.get("num_experts", hf.get("num_local_experts"))  # the hub's key; transformers 5 saves the second
  return gguf_check.MoE(int(n_expert), int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"]))


def arrays(hf_dir: str, arch: str, cfg, moe: Optional[gguf_check.MoE] = None) -> dict:
  """GGUF tensor name -> float32 array in llama.cpp's layout, layer-major (each layer one byte range); ``moe``:
  a qwen3moe checkpoint's experts (:func:`_qwen3_moe`)."""
  d = pathlib.Path(hf_dir)
  src = fhf._LazyTensors(fhf._tensor_files(d), np.dtype(np.float32))
  permute = arch == "llama"  # NORM RoPE: q/k rows (and biases) in adjacent-pair order; qwen is NEOX
  conv = (lambda p, m: names.hf_to_gguf(p, m, cfg)) if permute else (lambda p, m: m)
  ents, n_expert = names.entries(cfg), moe.n_expert if moe else 0
  if moe:  # the experts in place of the MLP
    ents = tuple(p for p in ents if p.path[0] != "mlp") + names.QWEN3_MOE
  extra = [p for p in names.EXTRA if p not in ents and p.hf.format(i=0) in src]
  if arch == "qwen2" and not all(p.hf.format(i=0) in src for p in names.QKV_BIASES):
    raise HFGGUFError(f"{hf_dir}: a Qwen2 checkpoint without q/k/v biases; re-save it with them")
  used, out = set(), {}

  def take(p, i=None):
    per = [p.hf.format(i=i, e=e) for e in range(n_expert)] if "{e}" in p.hf else \
        [p.hf.format(i=i) if i is not None else p.hf]  # experts: one HF tensor each, stacked (X, n_out, n_in)
    for name in per:
      if name not in src:
        raise HFGGUFError(f"{hf_dir} lacks tensor {name}; is it a complete {arch} checkpoint with {cfg.n_layers} "
                          f"layers?")
      used.add(name)
    w = np.stack([np.asarray(src[n]) for n in per]) if "{e}" in p.hf else np.asarray(src[per[0]])
    out[p.gguf.format(i=i) if i is not None else p.gguf] = np.ascontiguousarray(conv(p, w), np.float32)

  take(ents[0])
  for i in range(cfg.n_layers):
    for p in [q for q in ents if q.per_layer] + extra:
      take(p, i)
  for p in ents[1:]:
    if not p.per_layer:
      take(p)
  left = sorted(k for k in src if k not in used and not k.endswith(fhf._IGNORABLE_SUFFIXES)
                and not (cfg.tie_embeddings and k == "lm_head.weight"))
  if left:
    raise HFGGUFError(f"{hf_dir}: tensors {left[:3]} have no place in a {arch} GGUF; run it with llama.cpp")
  return out


def _token_text(t) -> Optional[str]:
  return t.get("content") if isinstance(t, dict) else t


def hf_vocab(hf_dir: str, vocab_size: int) -> vocab_lib.Vocab:
  """tokenizer.json (+ tokenizer_config.json) -> a GGUF vocabulary padded to the model's ``vocab_size``."""
  d = pathlib.Path(hf_dir)
  tj, tc = _json(d / "tokenizer.json"), _json(d / "tokenizer_config.json")
  if not tj:
    raise HFGGUFError(f"{hf_dir} has no tokenizer.json; save the tokenizer with the model (or export with the byte "
                      f"vocabulary: omit --hf-tokenizer)")
  m = tj.get("model") or {}
  if m.get("type") != "BPE":
    raise HFGGUFError(f"{hf_dir}/tokenizer.json: model type {m.get('type')!r}; only BPE tokenizers are converted")
  merges = [" ".join(x) if isinstance(x, list) else x for x in m.get("merges", [])]
  pre_tok = tj.get("pre_tokenizer") or {}
  pres = pre_tok.get("pretokenizers", [pre_tok]) if pre_tok else []
  kinds = [p.get("type") for p in pres]
  spm = "Metaspace" in kinds or any(n.get("type") == "Prepend" for n in (tj.get("normalizer") or {}).get(
      "normalizers", [tj.get("normalizer") or {}]))
  added = {int(t["id"]): t for t in tj.get("added_tokens", [])}
  n = max([vocab_size] + [i + 1 for i in m["vocab"].values()] + [i + 1 for i in added])
  if n > vocab_size:
    raise HFGGUFError(f"{hf_dir}: the tokenizer has {n} tokens but the model's vocab_size is {vocab_size}")
  tokens, types = [f"<unused_{i}>" for i in range(n)], [vocab_lib.UNUSED] * n
  for t, i in m["vocab"].items():
    tokens[i], types[i] = t, vocab_lib.NORMAL
    if spm and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
      types[i] = vocab_lib.BYTE
  for i, t in added.items():
    tokens[i], types[i] = t["content"], vocab_lib.CONTROL if t.get("special") else vocab_lib.USER_DEFINED
  ids = {t: i for i, t in enumerate(tokens)}
  bos, eos = ids.get(_token_text(tc.get("bos_token"))), ids.get(_token_text(tc.get("eos_token")))
  unk = ids.get(m.get("unk_token") or "")
  if unk is not None:
    types[unk] = vocab_lib.UNKNOWN
  pad = ids.get(_token_text(tc.get("pad_token")))
  add_bos = tc.get("add_bos_token")
  template = tc.get("chat_template")
  if spm:
    if not m.get("byte_fallback"):
      raise HFGGUFError(f"{hf_dir}/tokenizer.json: a Metaspace BPE without byte_fallback has no SPM equivalent")
    return vocab_lib.Vocab("llama", tokens, types, [-float(i) for i in range(n)], None, None, bos, eos, unk, pad,
                           add_bos=add_bos, add_space_prefix=True, chat_template=template)
  if kinds == ["ByteLevel"] and pres[0].get("use_regex", True):
    pre = "gpt-2"
  elif kinds == ["Split", "ByteLevel"] and not pres[1].get("use_regex", True):
    pre = _PRE_REGEX.get((pres[0].get("pattern") or {}).get("Regex"))
  else:
    pre = None
  if pre is None:
    raise HFGGUFError(f"{hf_dir}/tokenizer.json: pre_tokenizer {kinds} with this regex is not one llama.cpp "
                      f"implements as GPT-2, Llama 3 or Qwen2; export with the byte vocabulary instead")
  return vocab_lib.Vocab("gpt2", tokens, types, None, merges, pre, bos, eos, unk, pad, add_bos=add_bos,
                         chat_template=template)


def convert(hf_dir: str, out: str, quant: str = "f32", name: Optional[str] = None, tokenizer: bool = True) -> dict:
  """The checkpoint as a GGUF file; ``quant`` as ``gguf_io.export_gguf`` (K-quants through llama.cpp's quantiser).
  ``tokenizer=False``: PrismLLM's byte vocabulary (needs vocab_size >= 256)."""
  from ondevice import gguf_io
  if "MixtralForCausalLM" in (_json(pathlib.Path(hf_dir) / "config.json").get("architectures") or []):
    mcfg, params = fhf.load(hf_dir)
    voc = hf_vocab(hf_dir, mcfg.vocab_size) if tokenizer else None
    return gguf_io.export_moe_gguf(params, mcfg, out, quant, name=name or pathlib.Path(hf_dir).name, vocab=voc)
  arch, cfg, factors = read_config(hf_dir)
  moe = _qwen3_moe(hf_dir, _json(pathlib.Path(hf_dir) / "config.json")) if arch == "qwen3moe" else None
  arr = arrays(hf_dir, arch, cfg, moe)
  if factors is not None:
    arr = {"rope_freqs.weight": factors, **arr}
  voc = hf_vocab(hf_dir, cfg.vocab_size) if tokenizer else None
  name = name or pathlib.Path(hf_dir).name
  return gguf_io.write_quantized(arr, cfg, out, quant, name=name, arch=arch, vocab=voc, moe=moe)
