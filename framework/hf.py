"""Hugging Face ``transformers`` interop: checkpoint directory <-> (ModelConfig, params).

Architectures: ``LlamaForCausalLM`` (plain RoPE, or Llama 3.x's rope_scaling type 'llama3' ->
``model.rope_scaling='llama3'``), ``Qwen2ForCausalLM`` (q/k/v biases -> ``model.qkv_bias``) and
``MixtralForCausalLM`` (a mixture of experts: ``num_local_experts`` -> ``model.n_experts``,
``num_experts_per_tok`` -> ``experts_per_token``, ``intermediate_size`` -> ``moe_d_ff``, softmax router with the
top-k renormalised); tied or untied embeddings as ``tie_word_embeddings`` says. Export writes a
MixtralForCausalLM for a model with ``n_experts`` (refusing what Mixtral lacks: shared experts, a sigmoid router,
``router_scale`` != 1, a router bias; ``names.mixtral_unsupported``), a Qwen2ForCausalLM for one with
``qkv_bias``, a LlamaForCausalLM otherwise, with its RoPE scaling. HF's ``router_aux_loss_coef`` weighs a loss
``k`` times ours (its expert fractions sum to ``k``, ours to 1), so ``aux_loss_coef = k x router_aux_loss_coef``.

A HF checkpoint directory is ``config.json`` plus ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). Arrays are read and written with the ``safetensors`` numpy API:
no torch at run time. Which HF tensor is which framework parameter, and how it is laid out, is
``framework/names.py`` (the one name map, shared with GGUF export); this module only adds the
config mapping, file I/O and the workdir CLI. Our RoPE is HF's rotate-half layout (Llama and Qwen2
alike), so q/k load without any permutation.

  python -m framework.hf import --hf-dir D --workdir W [--config experiments/configs/x.py] [--config.a.b=v]
  python -m framework.hf export --workdir W --out D [--step N] [--dtype bfloat16]

``import`` writes a step-0 training checkpoint (fresh optimizer state) that ``experiments.run``
resumes from; ``export`` writes the latest (or ``--step``) checkpoint's params as a HF directory
that ``AutoModelForCausalLM.from_pretrained`` loads. What is not supported (and rejected with a message,
never silently mis-converted): other RoPE scalings (YaRN, linear, dynamic, ...), Llama attention/MLP
biases, Qwen2 sliding-window attention, activations other than SiLU, other architectures. Tokenizers are
not converted: PrismLLM's tokenizer is bytes, so an imported model keeps its vocabulary size but is fed
byte ids.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
from typing import Any, Iterator, Mapping, Optional

import numpy as np

from framework import config as config_lib
from framework import config_file, names
from framework.config import Config, ConfigError, ModelConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some HF checkpoints carry that are not parameters of the model (buffers of old versions).
_IGNORABLE_SUFFIXES = (".rotary_emb.inv_freq",)


class HFError(ValueError):
  """A checkpoint this converter cannot represent faithfully; the message names what differs."""


# ---------------------------------------------------------------- config mapping

# HF model_type -> the architecture class written on export; model.n_experts picks mixtral, model.qkv_bias qwen2.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}
# transformers' 'llama3' rope_scaling keys -> ModelConfig fields (framework/rope.py)
LLAMA3_ROPE_KEYS = (("factor", "rope_factor", float), ("low_freq_factor", "rope_low_freq_factor", float),
                    ("high_freq_factor", "rope_high_freq_factor", float),
                    ("original_max_position_embeddings", "rope_original_max_len", int))


def _rope_fields(hf: Mapping[str, Any]) -> dict:
  """RoPE keys of a HF config -> ModelConfig fields (rope_theta, and rope_scaling with its keys)."""
  # transformers >= 5 writes rope_parameters; older versions rope_theta + rope_scaling.
  rope = dict(hf.get("rope_parameters") or {})
  scaling = dict(hf.get("rope_scaling") or {})
  rope_type, params = rope.get("rope_type", rope.get("type", "default")), rope
  if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
    rope_type, params = scaling.get("rope_type", scaling.get("type")), scaling
  theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
  if rope_type == "default":
    return {"rope_theta": theta}
  if rope_type != "llama3":
    raise HFError(f"RoPE scaling {rope_type!r} is not implemented in framework/rope.py; plain RoPE "
                  f"(rope_type='default') and Llama 3.1's 'llama3' convert exactly")
  missing = [k for k, _, _ in LLAMA3_ROPE_KEYS if k not in params]
  if missing:
    raise HFError(f"rope_scaling of type 'llama3' lacks {missing[0]!r}: add it to config.json (transformers "
                  f"needs {', '.join(k for k, _, _ in LLAMA3_ROPE_KEYS)})")
  return dict(rope_theta=theta, rope_scaling="llama3", **{f: t(params[k]) for k, f, t in LLAMA3_ROPE_KEYS})


def model_config_from_hf(hf: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
  """HF ``config.json`` (dict) -> :class:`ModelConfig`; refuses features our model does not have."""
  mt = hf.get("model_type", "llama")
  if mt not in ARCHITECTURES:
    raise HFError(f"model_type={mt!r}: only 'llama' (LlamaForCausalLM), 'qwen2' (Qwen2ForCausalLM) and 'mixtral' "
                  f"(MixtralForCausalLM) checkpoints are supported")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise HFError(f"hidden_act={act!r}: the PrismLLM MLP is SwiGLU (silu)")
  if mt == "llama":
    if hf.get("attention_bias"):
      raise HFError("attention_bias=true: a Llama with attention_bias also has an o_proj bias, which PrismLLM "
                    "lacks (model.qkv_bias covers q/k/v only); convert a checkpoint without attention biases")
    if hf.get("mlp_bias"):
      raise HFError("mlp_bias=true: PrismLLM MLPs have no biases; convert a checkpoint without MLP biases")
  elif mt == "mixtral":
    if hf.get("sliding_window") is not None:
      raise HFError(f"sliding_window={hf['sliding_window']}: PrismLLM attends to the whole context (no sliding "
                    f"window); convert a checkpoint saved with sliding_window=null")
  elif hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ()):
    raise HFError("use_sliding_window=true: PrismLLM attends to the whole context (no sliding window); convert a "
                  "checkpoint saved with use_sliding_window=false")
  d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  head_dim = int(hf.get("head_dim") or d // h)
  moe = {}
  if mt == "mixtral":
    k = int(hf.get("num_experts_per_tok", 2))
    moe = dict(n_experts=int(hf.get("num_local_experts", 8)), experts_per_token=k,
               moe_d_ff=int(hf["intermediate_size"]), router="softmax", moe_norm_topk=True, router_scale=1.0,
               n_shared_experts=0, aux_loss_coef=k * float(hf.get("router_aux_loss_coef", 0.001)))
  cfg = ModelConfig(
      vocab_size=int(hf["vocab_size"]), d_model=d, n_layers=int(hf["num_hidden_layers"]), n_heads=h,
      n_kv_heads=int(hf.get("num_key_value_heads") or h),
      head_dim=0 if head_dim == d // h else head_dim,
      d_ff=int(hf["intermediate_size"]), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=mt == "qwen2",
      max_seq_len=int(hf.get("max_position_embeddings", 2048)), dtype=dtype, param_dtype=dtype, **_rope_fields(hf),
      **moe)
  try:
    config_lib.validate_model(cfg)
  except ConfigError as e:
    raise HFError(f"config.json: {e}") from None
  return cfg


def hf_config_from_model(cfg: ModelConfig, dtype: str = "float32") -> dict:
  """:class:`ModelConfig` -> HF ``config.json`` dict (readable by transformers 4.x and 5.x): a MixtralForCausalLM
  with ``n_experts``, a Qwen2ForCausalLM with ``qkv_bias``, a LlamaForCausalLM otherwise."""
  if cfg.mlp != "swiglu" or cfg.block != "sequential":
    raise HFError(f"model.mlp={cfg.mlp!r} / model.block={cfg.block!r}: Llama, Qwen2 and Mixtral are 'swiglu' MLPs "
                  f"in 'sequential' blocks; export a model with those")
  why = names.mixtral_unsupported(cfg)
  if why:
    raise HFError(why)
  mt = "mixtral" if cfg.moe else "qwen2" if cfg.qkv_bias else "llama"
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling == "llama3":
    rope = dict(rope, rope_type="llama3", **{k: getattr(cfg, f) for k, f, _ in LLAMA3_ROPE_KEYS})
  out = {
      "architectures": [ARCHITECTURES[mt]], "model_type": mt,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.expert_ff if cfg.moe else cfg.ff,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.hd, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      # Both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta (+ rope_scaling).
      "rope_theta": cfg.rope_theta, "rope_parameters": rope,
      "tie_word_embeddings": cfg.tie_embeddings,
      "attention_dropout": 0.0, "initializer_range": cfg.init_std, "use_cache": True,
      "torch_dtype": dtype, "dtype": dtype,
  }
  if cfg.rope_scaling != "none":
    out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
  if mt == "mixtral":
    out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token, sliding_window=None,
               router_aux_loss_coef=cfg.aux_loss_coef / cfg.experts_per_token, router_jitter_noise=0.0,
               output_router_logits=False)
  elif mt == "qwen2":
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
               layer_types=["full_attention"] * cfg.n_layers)
  else:
    out.update(attention_bias=False, mlp_bias=False)
  return out


# ---------------------------------------------------------------- safetensors I/O

class _LazyTensors(Mapping):
  """{HF name: numpy array} over one or many safetensors files; each tensor is read when asked for,
  so converting a sharded checkpoint never holds two copies of every weight."""

  def __init__(self, files_by_name: Mapping[str, pathlib.Path], dtype):
    from safetensors import safe_open  # noqa: PLC0415 - optional dependency, only for HF I/O
    self._where = dict(files_by_name)
    self._handles = {f: safe_open(str(f), framework="numpy") for f in set(self._where.values())}
    self._dtype = dtype

  def __getitem__(self, name: str) -> np.ndarray:
    if name not in self._where:
      raise KeyError(name)
    return self._handles[self._where[name]].get_tensor(name).astype(self._dtype)

  def __iter__(self) -> Iterator[str]:
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)


def _tensor_files(hf_dir: pathlib.Path) -> dict:
  """HF tensor name -> file holding it (single file, index-listed shards, or any *.safetensors)."""
  index = hf_dir / INDEX_FILE
  if index.exists():
    wm = json.loads(index.read_text())["weight_map"]
    return {k: hf_dir / v for k, v in wm.items()}
  files = [hf_dir / SINGLE_FILE] if (hf_dir / SINGLE_FILE).exists() else sorted(hf_dir.glob("*.safetensors"))
  if not files:
    raise HFError(f"{hf_dir} has no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors; PyTorch .bin checkpoints "
                  f"are not read (re-save with save_pretrained(..., safe_serialization=True))")
  from safetensors import safe_open  # noqa: PLC0415
  out = {}
  for f in files:
    with safe_open(str(f), framework="numpy") as h:
      out.update({k: f for k in h.keys()})
  return out


def read_config(hf_dir: str, dtype: str = "float32") -> ModelConfig:
  """The :class:`ModelConfig` of a HF checkpoint directory (reads config.json only)."""
  f = pathlib.Path(hf_dir) / CONFIG_FILE
  if not f.exists():
    raise HFError(f"{hf_dir} has no {CONFIG_FILE}: pass the directory written by save_pretrained")
  return model_config_from_hf(json.loads(f.read_text()), dtype)


def load(hf_dir: str, dtype: str = "float32", scan_layers: bool = True) -> tuple:
  """Reads a HF Llama / Qwen2 / Mixtral checkpoint directory -> (ModelConfig, params tree of numpy arrays).

  ``dtype`` is the parameter (and compute) dtype of the returned model; ``scan_layers`` picks the
  stacked ('layers', leading L axis) or unrolled ('layers_{i}') parameter layout."""
  d = pathlib.Path(hf_dir)
  cfg = dataclasses.replace(read_config(hf_dir, dtype), scan_layers=scan_layers)
  arrays = _LazyTensors(_tensor_files(d), np.dtype(_np_dtype(dtype)))
  used = {n for p in names.entries(cfg) for n in names.layer_names(p, p.hf, cfg)}
  extra = sorted(k for k in arrays if k not in used and not k.endswith(_IGNORABLE_SUFFIXES)
                 and not (cfg.tie_embeddings and k == "lm_head.weight"))
  if extra:
    raise HFError(f"{len(extra)} tensors in {d} have no PrismLLM parameter (e.g. {extra[:4]}): the checkpoint "
                  f"is not a plain {'Mixtral' if cfg.moe else 'Qwen2' if cfg.qkv_bias else 'Llama'} with "
                  f"{cfg.n_layers} layers")
  try:
    params = names.hf_to_framework(arrays, cfg)
  except KeyError as e:
    raise HFError(str(e)) from e
  return cfg, params


def save(params: Any, cfg: ModelConfig, out_dir: str, dtype: Optional[str] = None,
         max_shard_bytes: int = 4 << 30) -> pathlib.Path:
  """Writes framework params as a HF Llama / Qwen2 / Mixtral directory (config.json + model.safetensors, or shards
  with an index past ``max_shard_bytes``). ``dtype`` defaults to the model's param dtype."""
  from safetensors.numpy import save_file  # noqa: PLC0415
  dtype = dtype or cfg.param_dtype
  hf_cfg = hf_config_from_model(cfg, dtype)  # refuses what HF cannot represent before anything is written
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  arrays = {k: np.ascontiguousarray(v.astype(_np_dtype(dtype)))
            for k, v in names.framework_to_hf(params, cfg).items()}
  (out / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2) + "\n")
  shards, cur, size = [], {}, 0
  for k, v in arrays.items():
    if cur and size + v.nbytes > max_shard_bytes:
      shards.append(cur)
      cur, size = {}, 0
    cur[k] = v
    size += v.nbytes
  shards.append(cur)
  meta = {"format": "pt"}  # transformers refuses safetensors files without a known format tag
  if len(shards) == 1:
    save_file(shards[0], str(out / SINGLE_FILE), metadata=meta)
    (out / INDEX_FILE).unlink(missing_ok=True)
    return out
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, str(out / fname), metadata=meta)
    weight_map.update({k: fname for k in shard})
  total = sum(v.nbytes for v in arrays.values())
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
  (out / SINGLE_FILE).unlink(missing_ok=True)
  return out


def _np_dtype(name: str):
  import jax.numpy as jnp  # noqa: PLC0415 - jnp.dtype knows bfloat16 (ml_dtypes)
  return jnp.dtype(name)


# ---------------------------------------------------------------- workdir <-> HF directory

def _state_for(cfg: Config, params=None, rng_seed: int = 0):
  """A train state of ``cfg`` (unboxed), built from ``params`` when given; also its abstract twin."""
  # jax, flax and the model only for workdir conversion: reading and writing HF directories runs without them.
  import flax.linen as nn  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from framework import model as model_lib  # noqa: PLC0415
  from framework import optim  # noqa: PLC0415
  from framework import train_step as ts  # noqa: PLC0415
  model = model_lib.build(cfg.model)
  tx = optim.make(cfg.optim, cfg.train.steps)
  shapes = jax.eval_shape(lambda: nn.unbox(ts.init_state(jax.random.key(rng_seed), model, tx)))
  dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), shapes)
  if params is None:
    return None, abstract
  params = jax.tree.map(lambda a, s: jnp.asarray(a, s.dtype), params, shapes.params)
  state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
  return state, abstract


def import_to_workdir(hf_dir: str, workdir: str, cfg: Config = Config(),
                      n_devices: Optional[int] = None) -> Config:
  """Writes ``hf_dir``'s weights as the step-0 checkpoint of ``workdir`` (fresh optimizer state of
  ``cfg.optim``); ``cfg.model`` is replaced by the checkpoint's. With ``n_devices``, the result is
  validated for that many devices first (e.g. heads vs. mesh.tensor), so nothing is written for a
  layout that cannot train it. Returns the config to train with."""
  from framework import checkpoint as ckpt_lib  # noqa: PLC0415 - orbax, only for workdirs
  m = cfg.model
  mcfg = read_config(hf_dir)
  mcfg = dataclasses.replace(mcfg, dtype=m.dtype, param_dtype=m.param_dtype, scan_layers=m.scan_layers,
                             remat=m.remat, init_std=m.init_std,
                             max_seq_len=max(mcfg.max_seq_len, cfg.data.seq_len))
  cfg = dataclasses.replace(cfg, model=mcfg)
  if n_devices is not None:
    config_lib.validate(cfg, n_devices)
  _, params = load(hf_dir, dtype=m.param_dtype, scan_layers=m.scan_layers)
  state, _ = _state_for(cfg, params)
  os.makedirs(workdir, exist_ok=True)
  ck = ckpt_lib.Checkpointer(workdir, dataclasses.replace(cfg.checkpoint, async_save=False))
  if ck.latest_step() is not None:
    ck.close()
    raise ConfigError(f"{ck.dir} already holds checkpoints; import into a fresh --workdir")
  ck.save(0, state, {"step": 0, "seed": cfg.data.seed}, force=True)
  ck.close()
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config_lib.to_dict(cfg), f, indent=1, default=str)
  return cfg


def export_from_workdir(workdir: str, out_dir: str, step: Optional[int] = None,
                        dtype: Optional[str] = None) -> pathlib.Path:
  """Writes a workdir checkpoint's params (latest, or ``step``) as a HF Llama / Qwen2 / Mixtral directory."""
  import jax  # noqa: PLC0415

  from framework import checkpoint as ckpt_lib  # noqa: PLC0415 - orbax, only for workdirs
  cfg_path = os.path.join(workdir, "config.json")
  if not os.path.exists(cfg_path):
    raise ConfigError(f"{cfg_path} not found: pass the --workdir of a training run (it writes config.json)")
  with open(cfg_path) as f:
    cfg = config_lib.from_dict(json.load(f))
  _, abstract = _state_for(cfg)
  ck = ckpt_lib.Checkpointer(workdir, cfg.checkpoint)
  try:
    state, _ = ck.restore(abstract, step)
  finally:
    ck.close()
  return save(jax.device_get(state.params), cfg.model, out_dir, dtype=dtype)


# ---------------------------------------------------------------- CLI

def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m framework.hf", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  pi = sub.add_parser("import", help="HF directory -> step-0 checkpoint in a workdir")
  pi.add_argument("--hf-dir", required=True)
  pi.add_argument("--workdir", required=True)
  pi.add_argument("--config", default=None, help="experiment config whose optim/data/train settings to use")
  pe = sub.add_parser("export", help="workdir checkpoint -> HF directory")
  pe.add_argument("--workdir", required=True)
  pe.add_argument("--out", required=True)
  pe.add_argument("--step", type=int, default=None)
  pe.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the param dtype)")
  args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
  try:
    if args.cmd == "import":
      if rest and not args.config:
        p.error("--config.* overrides need --config")
      cfg = config_file.load(args.config, rest) if args.config else Config()
      sizes = cfg.mesh.sizes().values()
      # Check the layout the training command will use (a -1 axis fills whatever devices it finds).
      n_dev = None if -1 in sizes else math.prod(sizes)
      cfg = import_to_workdir(args.hf_dir, args.workdir, cfg, n_devices=n_dev)
      m = cfg.model
      keys = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "rope_theta",
              "norm_eps", "tie_embeddings", "max_seq_len"]
      keys += [k for k in ("rope_scaling",) + tuple(f for _, f, _ in LLAMA3_ROPE_KEYS) + ("qkv_bias", "n_experts",
                                                                                      "experts_per_token", "moe_d_ff",
                                                                                      "aux_loss_coef")
               if getattr(m, k) != getattr(ModelConfig(), k)]
      ov = " ".join(rest + [f"--config.model.{k}={getattr(m, k)!r}" for k in keys])
      print(f"imported {m.n_params() / 1e6:.2f}M params into {os.path.abspath(args.workdir)}; train on with:\n"
            f"  python -m experiments.run --config {args.config or 'CONFIG'} --workdir {args.workdir} {ov}")
    else:
      if rest:
        p.error(f"unrecognised arguments {rest}")
      out = export_from_workdir(args.workdir, args.out, args.step, args.dtype)
      print(f"wrote {out}")
  except (HFError, ConfigError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
