"""The weights name map: framework parameter path <-> Hugging Face name <-> GGUF (llama.cpp) name.

One table (:data:`TABLE`) says, for every parameter of ``framework/model.py``, what it is called in
each format and how its array is laid out. Everything that converts weights (HF conversion, GGUF
export/import, the on-device runtime) goes through this module, so a layout fact lives in one place.

Layouts (per layer; the framework stacks layers on a leading ``L`` axis when ``scan_layers``):

  framework           HF / GGUF matrix (n_out, n_in)        note
  attn/wq  D x H x E  q_proj  (H*E, D)  attn_q               GGUF rows RoPE-permuted (see below)
  attn/wk  D x K x E  k_proj  (K*E, D)  attn_k               GGUF rows RoPE-permuted
  attn/wv  D x K x E  v_proj  (K*E, D)  attn_v
  attn/wo  H x E x D  o_proj  (D, H*E)  attn_output
  mlp/w_gate D x F    gate_proj (F, D)  ffn_gate
  mlp/w_up   D x F    up_proj   (F, D)  ffn_up
  mlp/w_down F x D    down_proj (D, F)  ffn_down
  embed/embedding V x D   embed_tokens (V, D)  token_embd    (a row table, not transposed)
  lm_head/kernel  D x V   lm_head (V, D)       output        (absent when embeddings are tied)
  norms (D,)          *_layernorm / norm     *_norm
  moe/router D x X    block_sparse_moe.gate (X, D)            ffn_gate_inp   (X experts; kept F32 in GGUF)
  moe/we_gate X x D x F  experts.{e}.w1 (F, D) each  ffn_gate_exps (X, F, D)  (one GGUF tensor per layer)
  moe/we_up   X x D x F  experts.{e}.w3 (F, D) each  ffn_up_exps   (X, F, D)
  moe/we_down X x F x D  experts.{e}.w2 (D, F) each  ffn_down_exps (X, D, F)

A mixture-of-experts model (``model.n_experts > 0``) is written as Mixtral: HF ``MixtralForCausalLM`` (its
``block_sparse_moe`` in place of ``mlp``) and llama.cpp's ``llama`` architecture with ``llama.expert_count``.
Mixtral's router is a softmax whose top-k weights are renormalised, with no scale, bias or shared experts:
:func:`mixtral_unsupported` names what else a model has.

GGUF stores a numpy array of shape (n_out, n_in) with ggml ``ne = [n_in, n_out]``.

RoPE. The framework and HF rotate *halves* of each head (dims j and j + E/2 form a pair).
llama.cpp's llama architecture uses rope mode NORM, which rotates *adjacent* dims (2j, 2j+1).
``convert_hf_to_gguf.py`` reconciles the two by permuting the output rows of q/k inside every head:
GGUF row (h, j, half) = HF row (h, half, j). :func:`permute_rope` / :func:`unpermute_rope` are that
permutation and its inverse; nothing else in the repo may re-implement it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from framework.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamName:
  """One parameter in the three naming schemes; ``{i}`` in a name is the layer index."""
  path: tuple  # framework path inside params, without the 'layers' prefix for per-layer params
  hf: str
  gguf: str
  per_layer: bool
  kind: str  # 'in_out' (D x ... -> transpose), 'heads_in' (H x E x D), 'rows' (V x D), 'vector',
  #            'experts' (X x n_in x n_out: X stacked matrices, each transposed; HF names one per expert, '{e}')
  rope_heads: str = ""  # '' | 'q' | 'kv': which head count the GGUF RoPE permutation uses


TABLE: tuple = (
    ParamName(("embed", "embedding"), "model.embed_tokens.weight", "token_embd.weight", False, "rows"),
    ParamName(("attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight",
              True, "vector"),
    ParamName(("attn", "wq"), "model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight", True,
              "in_out", "q"),
    ParamName(("attn", "wk"), "model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight", True,
              "in_out", "kv"),
    ParamName(("attn", "wv"), "model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight", True,
              "in_out"),
    ParamName(("attn", "wo"), "model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", True,
              "heads_in"),
    ParamName(("mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight",
              "blk.{i}.ffn_norm.weight", True, "vector"),
    ParamName(("mlp", "w_gate"), "model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", True,
              "in_out"),
    ParamName(("mlp", "w_up"), "model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight", True, "in_out"),
    ParamName(("mlp", "w_down"), "model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight", True,
              "in_out"),
    ParamName(("final_norm", "scale"), "model.norm.weight", "output_norm.weight", False, "vector"),
    ParamName(("lm_head", "kernel"), "lm_head.weight", "output.weight", False, "in_out"),
)

BY_GGUF_SUFFIX = {p.gguf.replace("blk.{i}.", ""): p for p in TABLE}

# Parameters other decoder families add to the Llama layer: Qwen2's q/k/v biases (also Llama checkpoints with
# attention_bias), Qwen3's per-head RMSNorm of q and k. framework/model.py has the biases (model.qkv_bias: H x E
# and K x E arrays), not the norms; the HF -> GGUF export (ondevice/hf_gguf.py) names all of them here. Biases of
# q/k follow the rows' RoPE order.
EXTRA: tuple = (
    ParamName(("attn", "bq"), "model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias", True, "vector", "q"),
    ParamName(("attn", "bk"), "model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias", True, "vector", "kv"),
    ParamName(("attn", "bv"), "model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias", True, "vector"),
    ParamName(("attn", "q_norm"), "model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", True,
              "vector"),
    ParamName(("attn", "k_norm"), "model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", True,
              "vector"),
)


QKV_BIASES: tuple = EXTRA[:3]

# A mixture-of-experts layer in place of the MLP, in Mixtral's names (HF MixtralForCausalLM; llama.cpp 'llama'
# with experts). HF has one tensor per expert ('{e}'), GGUF one stacked (X, n_out, n_in) tensor per layer.
_EXP = "model.layers.{i}.block_sparse_moe.experts.{e}."
MOE: tuple = (
    ParamName(("moe", "router"), "model.layers.{i}.block_sparse_moe.gate.weight", "blk.{i}.ffn_gate_inp.weight",
              True, "in_out"),
    ParamName(("moe", "we_gate"), _EXP + "w1.weight", "blk.{i}.ffn_gate_exps.weight", True, "experts"),
    ParamName(("moe", "we_up"), _EXP + "w3.weight", "blk.{i}.ffn_up_exps.weight", True, "experts"),
    ParamName(("moe", "we_down"), _EXP + "w2.weight", "blk.{i}.ffn_down_exps.weight", True, "experts"),
)

# Qwen3-MoE's names (HF Qwen3MoeForCausalLM; llama.cpp 'qwen3moe'): the same GGUF tensors as MOE. The framework has
# no Qwen3 attention (per-head q/k norms); ondevice/hf_gguf.py converts such checkpoints to GGUF directly.
_QEXP = "model.layers.{i}.mlp.experts.{e}."
QWEN3_MOE: tuple = (
    ParamName(("moe", "router"), "model.layers.{i}.mlp.gate.weight", "blk.{i}.ffn_gate_inp.weight", True, "in_out"),
    ParamName(("moe", "we_gate"), _QEXP + "gate_proj.weight", "blk.{i}.ffn_gate_exps.weight", True, "experts"),
    ParamName(("moe", "we_up"), _QEXP + "up_proj.weight", "blk.{i}.ffn_up_exps.weight", True, "experts"),
    ParamName(("moe", "we_down"), _QEXP + "down_proj.weight", "blk.{i}.ffn_down_exps.weight", True, "experts"),
)


def entries(cfg: ModelConfig) -> tuple:
  """The table entries present in a model built from ``cfg`` (no lm_head with tied embeddings; the q/k/v biases
  with ``qkv_bias``; :data:`MOE` in place of the MLP with ``n_experts``)."""
  out: tuple = ()
  for p in TABLE:
    if (cfg.tie_embeddings and p.path[0] == "lm_head") or (cfg.moe and p.path[0] == "mlp"):
      continue
    out += (p,) + (MOE if cfg.moe and p.path[0] == "mlp_norm" else ())
  return out + (QKV_BIASES if cfg.qkv_bias else ())


def mixtral_unsupported(cfg: ModelConfig) -> str:
  """'' when ``cfg`` is a dense model or a mixture of experts that Mixtral (HF MixtralForCausalLM, llama.cpp's
  llama MoE) computes exactly; else one line naming the setting and the fix."""
  if not cfg.moe:
    return ""
  bad = [(cfg.n_shared_experts, f"model.n_shared_experts={cfg.n_shared_experts}", "n_shared_experts=0"),
         (cfg.router != "softmax", f"model.router={cfg.router!r}", "router='softmax'"),
         (not cfg.moe_norm_topk, "model.moe_norm_topk=False", "moe_norm_topk=True"),
         (cfg.router_scale != 1.0, f"model.router_scale={cfg.router_scale}", "router_scale=1"),
         (cfg.router_bias_rate, f"model.router_bias_rate={cfg.router_bias_rate} (a router bias)",
          "router_bias_rate=0"),
         (cfg.qkv_bias, "model.qkv_bias=True", "qkv_bias=False")]
  for flag, what, fix in bad:
    if flag:
      return (f"{what}: a mixture of experts is exported as Mixtral (softmax router, top-k renormalised, no scale, "
              f"router bias, shared experts or q/k/v biases), which cannot express it; train with model.{fix}")
  return ""


# ---------------------------------------------------------------- RoPE permutation (the one place)

def permute_rope(w_OxI: np.ndarray, n_heads: int) -> np.ndarray:
  """HF rotate-half row order -> llama.cpp adjacent-pair (NORM) row order, per head."""
  o = w_OxI.shape[0]
  e = o // n_heads
  if o % n_heads or e % 2:
    raise ValueError(f"cannot RoPE-permute {w_OxI.shape}: rows {o} must be n_heads={n_heads} x even head_dim")
  return w_OxI.reshape(n_heads, 2, e // 2, *w_OxI.shape[1:]).swapaxes(1, 2).reshape(w_OxI.shape)


def unpermute_rope(w_OxI: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of :func:`permute_rope`."""
  o = w_OxI.shape[0]
  e = o // n_heads
  if o % n_heads or e % 2:
    raise ValueError(f"cannot RoPE-unpermute {w_OxI.shape}: rows {o} must be n_heads={n_heads} x even head_dim")
  return w_OxI.reshape(n_heads, e // 2, 2, *w_OxI.shape[1:]).swapaxes(1, 2).reshape(w_OxI.shape)


def _rope_heads(p: ParamName, cfg: ModelConfig) -> int:
  return {"q": cfg.n_heads, "kv": cfg.n_kv_heads}.get(p.rope_heads, 0)


# ---------------------------------------------------------------- per-array layout conversion

def to_hf(p: ParamName, w: np.ndarray) -> np.ndarray:
  """One framework array (single layer) -> the HF array (n_out, n_in) or vector."""
  w = np.asarray(w)
  if p.kind == "vector":  # norms (D,), biases H x E -> (H*E,)
    return np.ascontiguousarray(w.reshape(-1))
  if p.kind == "in_out":  # D x ... (x E) -> (out, D)
    return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)
  if p.kind == "heads_in":  # H x E x D -> (D, H*E)
    return np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)
  if p.kind == "experts":  # X x n_in x n_out -> (X, n_out, n_in)
    return np.ascontiguousarray(w.swapaxes(-1, -2))
  return w


def from_hf(p: ParamName, m: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  """Inverse of :func:`to_hf`: HF array -> framework array (single layer)."""
  m = np.asarray(m)
  D, H, K, E, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.hd, cfg.ff, cfg.vocab_size
  X, Fe = cfg.n_experts, cfg.expert_ff
  shapes = {"wq": (D, H, E), "wk": (D, K, E), "wv": (D, K, E), "wo": (H, E, D), "w_gate": (D, F),
            "w_up": (D, F), "w_down": (F, D), "embedding": (V, D), "kernel": (D, V), "scale": (D,), "bq": (H, E),
            "bk": (K, E), "bv": (K, E), "router": (D, X), "we_gate": (X, D, Fe), "we_up": (X, D, Fe),
            "we_down": (X, Fe, D)}
  want = shapes[p.path[-1]]
  if p.kind == "experts":
    out = m.swapaxes(-1, -2).reshape(want)
  elif p.kind == "in_out":
    out = m.T.reshape(want)
  elif p.kind == "heads_in":
    out = m.T.reshape(want)
  else:
    out = m.reshape(want)
  return np.ascontiguousarray(out)


def hf_to_gguf(p: ParamName, m: np.ndarray, cfg: ModelConfig, arch: str = "llama") -> np.ndarray:
  """HF array -> GGUF array of ``arch``: q/k rows RoPE-permuted for llama (NORM RoPE); qwen2/qwen3 rotate halves
  (NEOX), as HF does, so their rows stay."""
  n = _rope_heads(p, cfg) if arch == "llama" else 0
  return permute_rope(m, n) if n else m


def gguf_to_hf(p: ParamName, m: np.ndarray, cfg: ModelConfig, arch: str = "llama") -> np.ndarray:
  n = _rope_heads(p, cfg) if arch == "llama" else 0
  return unpermute_rope(m, n) if n else m


# ---------------------------------------------------------------- whole param trees

def _unbox(params: Any) -> Any:
  try:
    from flax.core import meta  # only needed for boxed (logically partitioned) trees
    params = meta.unbox(params)
  except ImportError:  # pragma: no cover
    pass
  return params


def _get(tree: Mapping, path: tuple):
  for k in path:
    tree = tree[k]
  return tree


def _layer_arrays(params: Mapping, p: ParamName, n_layers: int) -> list:
  """Per-layer numpy arrays of a per-layer parameter, scanned ('layers') or unrolled ('layers_{i}')."""
  if "layers" in params:
    stacked = np.asarray(_get(params["layers"], p.path))
    return [stacked[i] for i in range(n_layers)]
  return [np.asarray(_get(params[f"layers_{i}"], p.path)) for i in range(n_layers)]


def _convert_out(params: Any, cfg: ModelConfig, name_of: Callable, conv: Callable) -> dict:
  # Layer-major order (embedding, blk.0.*, blk.1.*, ..., final norm, output): written in this order,
  # each layer's tensors form one contiguous byte range of a GGUF file (what mmap windows need).
  params = _unbox(params)
  ents = entries(cfg)
  per_layer = {p: _layer_arrays(params, p, cfg.n_layers) for p in ents if p.per_layer}
  out = {}
  for p in ents[:1]:
    out[name_of(p)] = conv(p, np.asarray(_get(params, p.path)))
  for i in range(cfg.n_layers):
    for p, ws in per_layer.items():
      w, name = conv(p, ws[i]), name_of(p)
      if "{e}" in name:  # HF: one tensor per expert
        out.update({name.format(i=i, e=e): np.ascontiguousarray(w[e]) for e in range(w.shape[0])})
      else:
        out[name.format(i=i)] = w
  for p in ents[1:]:
    if not p.per_layer:
      out[name_of(p)] = conv(p, np.asarray(_get(params, p.path)))
  return out


def framework_to_hf(params: Any, cfg: ModelConfig) -> dict:
  """Framework params (boxed or not, scanned or not) -> {HF name: numpy array}."""
  return _convert_out(params, cfg, lambda p: p.hf, to_hf)


def framework_to_gguf(params: Any, cfg: ModelConfig, arch: str = "llama") -> dict:
  """Framework params -> {GGUF name: f32/f16 numpy array (n_out, n_in)}, q/k RoPE-permuted for llama."""
  return _convert_out(params, cfg, lambda p: p.gguf, lambda p, w: hf_to_gguf(p, to_hf(p, w), cfg, arch))


def _convert_in(arrays: Mapping, cfg: ModelConfig, name_of: Callable, conv: Callable, scan: bool,
                fmt: str) -> dict:
  missing = [name_of(p).format(i=0, e=0) for p in entries(cfg) if name_of(p).format(i=0, e=0) not in arrays]
  if missing:
    raise KeyError(f"{fmt} weights lack {missing}; is this a Llama-architecture checkpoint with "
                   f"{cfg.n_layers} layers, tie_embeddings={cfg.tie_embeddings}, qkv_bias={cfg.qkv_bias} and "
                   f"n_experts={cfg.n_experts}?")

  def layer(p, i):
    name = name_of(p)
    if "{e}" in name:  # HF: one tensor per expert, stacked
      return np.stack([np.asarray(arrays[name.format(i=i, e=e)]) for e in range(cfg.n_experts)])
    return arrays[name.format(i=i)]

  params: dict = {}
  for p in entries(cfg):
    if p.per_layer:
      ws = [conv(p, layer(p, i)) for i in range(cfg.n_layers)]
      if scan:
        _set(params, ("layers",) + p.path, np.stack(ws))
      else:
        for i, w in enumerate(ws):
          _set(params, (f"layers_{i}",) + p.path, w)
    else:
      _set(params, p.path, conv(p, arrays[name_of(p)]))
  return params


def layer_names(p: ParamName, name: str, cfg: ModelConfig) -> list:
  """Every file name of ``p`` (its HF or GGUF name ``name``) in a model of ``cfg``: one per layer, and per
  expert for HF's experts."""
  layers = range(cfg.n_layers) if p.per_layer else [0]
  experts = range(cfg.n_experts) if "{e}" in name else [0]
  return [name.format(i=i, e=e) for i in layers for e in experts]


def _set(tree: dict, path: tuple, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def hf_to_framework(arrays: Mapping, cfg: ModelConfig) -> dict:
  """{HF name: array} -> framework params tree (plain numpy, layout per ``cfg.scan_layers``)."""
  return _convert_in(arrays, cfg, lambda p: p.hf, lambda p, m: from_hf(p, m, cfg), cfg.scan_layers, "HF")


def gguf_to_framework(arrays: Mapping, cfg: ModelConfig, arch: str = "llama") -> dict:
  """{GGUF name: dequantized (n_out, n_in) array} of an ``arch`` file -> framework params tree."""
  return _convert_in(arrays, cfg, lambda p: p.gguf, lambda p, m: from_hf(p, gguf_to_hf(p, m, cfg, arch), cfg),
                     cfg.scan_layers, "GGUF")
