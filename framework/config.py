"""Typed, frozen configuration for PrismLLM.

Experiment files (``experiments/configs/*.py``) build an ``ml_collections.ConfigDict``; it is
converted exactly once, by :func:`from_dict`, into the frozen dataclasses below (the model section,
:class:`ModelConfig`, is framework/model_config.py's). Library code only ever sees these dataclasses.
Unknown keys are errors (a typo must never silently do nothing).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from framework.model_config import (  # noqa: F401  (re-exported: config.ModelConfig, config.ConfigError, ...)
    ATTENTION_KINDS, BLOCK_KINDS, MATMUL_PRECISIONS, MLP_KINDS, MOE_IMPLS, REMAT_POLICIES, ROPE_SCALINGS, ROUTERS,
    ConfigError, ModelConfig, validate_model)

MESH_AXES = ("pipeline", "data", "fsdp", "sequence", "expert", "tensor")
DATA_FORMATS = ("auto", "text", "jsonl", "parquet")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Training data (framework/data.py; document datasets: framework/documents.py; tokenizers: tokenizer.py).

  Text corpora (``stdlib``, a text file or folder) are read into memory (``max_bytes``) and sampled as random
  windows; jsonl / parquet documents are streamed, ended by an EOS token, packed into ``seq_len + 1`` windows and
  shuffled in blocks of ``shuffle_windows``. ``model.vocab_size`` must cover ``tokenizer``'s vocabulary.
  """
  corpus: str = "stdlib"  # "stdlib", a text file / folder, or a .jsonl / .parquet file / folder
  max_bytes: int = 16_000_000  # cap on a text corpus read into memory
  seq_len: int = 128
  global_batch: int = 16  # sequences per step, all processes together
  eval_fraction: float = 0.02
  seed: int = 0
  extensions: tuple = (".py", ".txt", ".md", ".rst")  # text files a text-corpus folder contributes
  tokenizer: str = "bytes"  # "bytes", a Hugging Face tokenizer.json or a SentencePiece .model
  format: str = "auto"  # one of DATA_FORMATS
  text_key: str = "text"  # the document field of a jsonl row / the column of a parquet file
  eos_token: str = ""  # the token that ends each document; "" -> the tokenizer's own (bytes: byte 0)
  shuffle_windows: int = 1024  # document datasets: windows shuffled together (rounded up to global_batch)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW (framework/optim.py). Two keys decide where its state lives and in what precision:

  ``shard_optimizer_state``: ZeRO-1, Megatron's distributed optimizer (``--use-distributed-optimizer``),
  MaxText's ``shard_optimizer_over_data``: the optimizer state (moments, and the masters below) is sharded over
  the data-parallel mesh axes (``data``, ``fsdp``, ``sequence``) a parameter is replicated on; gradients are
  reduce-scattered onto those shards, each device updates its shard, and the updated parameters are
  all-gathered (parallelism/zero.py). Parameters themselves keep the layout of ``mesh.rules``.

  ``master_weights``: float32 master copies of lower-precision parameters (``model.param_dtype=bfloat16``) in
  the optimizer state; the update runs on the masters (float32 moments too), and the parameters are their
  cast. Gradients are taken with respect to the parameters in the compute dtype (``model.dtype``) and the
  optimizer sees them as float32.
  """
  lr: float = 3e-3
  warmup_steps: int = 20
  decay_steps: int = 0  # 0 -> train.steps
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  eps: float = 1e-8
  shard_optimizer_state: bool = False  # ZeRO-1: optimizer state sharded over the data-parallel axes
  master_weights: bool = False  # float32 masters of lower-precision params (model.param_dtype) in the state


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes. Their product must equal the number of devices (-1 = fill).

  ``tensor_sequence_parallel``: Megatron's sequence parallelism of the tensor axis (``--sequence-parallel``,
  Korthikanti et al. 2022): between the matmuls the residual stream, the norms and the pipeline's activations
  hold ``1/tensor`` of the (local) sequence per device instead of a copy of all of it; the normed input of each
  column-parallel projection is all-gathered along the sequence over ``tensor`` and each row-parallel output is
  reduce-scattered onto it (in place of the all-reduce). Same function and gradients, ``~tensor`` times less
  activation memory outside the matmuls. Needs ``form='shard_map'`` and ``data.seq_len / sequence`` divisible by
  ``tensor``; a no-op when ``tensor == 1``.

  ``expert``: expert parallelism (``model.n_experts > 0``). The batch is split over it like a data axis (attention
  and the dense parts are data-parallel over it), the experts are split over it, and each MoE layer sends every
  token to the device holding its expert and back (two ``all_to_all`` per layer in the shard_map form; sharding
  rules in the jit form; framework/moe.py).
  """
  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  sequence: int = 1
  pipeline: int = 1
  expert: int = 1  # expert parallelism (MoE): experts and the batch split over it
  rules: str = "default"  # named logical-axis rule preset (parallelism/rules.py)
  form: str = "jit"  # "jit" (GSPMD auto-sharding) or "shard_map" (explicit collectives)
  microbatches: int = 1  # pipeline micro-batches; without a pipeline (jit form): gradient accumulation steps
  schedule: str = "gpipe"  # "gpipe" or "1f1b" (parallelism/schedules.py)
  # Layer chunks per pipeline stage, placed round-robin: with schedule=1f1b Megatron's interleaved 1F1B (vpp), with
  # schedule=gpipe MaxText's circular pipeline (num_pipeline_repeats). The layer stack is stored as
  # virtual_stages x n_layers/virtual_stages.
  virtual_stages: int = 1
  tensor_sequence_parallel: bool = False  # residual stream sharded along the sequence over 'tensor' (shard_map form)

  def sizes(self) -> dict:
    return {a: getattr(self, a) for a in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 50  # steps between saves; 0 disables
  keep: int = 2
  async_save: bool = True
  restore: bool = True  # resume from the latest checkpoint in the workdir if there is one


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 200
  log_every: int = 10
  eval_every: int = 0  # 0 disables periodic eval
  eval_batches: int = 4
  seed: int = 0
  sample_prompt: str = "def "
  sample_tokens: int = 64
  sample_temperature: float = 0.0
  progress: bool = True
  peak_flops: float = 0.0  # device peak FLOP/s for MFU; 0 -> measured at start-up (matmul probe)
  tensorboard: bool = True  # metrics.jsonl's records also as TensorBoard scalars in <workdir>/tensorboard/
  profile_steps: tuple = ()  # (START, COUNT): a jax.profiler trace of those steps in <workdir>/profile/


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  mesh: MeshConfig = MeshConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  train: TrainConfig = TrainConfig()
  name: str = "experiment"
  extras: tuple = ()  # (key, value) pairs for other floors (resilience, perfmodel, ...), read as data


_SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "mesh": MeshConfig,
                  "checkpoint": CheckpointConfig, "train": TrainConfig}


def _build(cls, values: Mapping[str, Any], where: str):
  known = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - set(known))
  if unknown:
    raise ConfigError(f"unknown config key(s) {', '.join(where + '.' + k for k in unknown)}; "
                      f"known keys of '{where}': {', '.join(sorted(known))}")
  kwargs = {}
  for k, v in values.items():
    default = known[k].default
    if isinstance(default, tuple) and isinstance(v, list):
      v = tuple(v)
    if isinstance(default, bool) and not isinstance(v, bool):
      raise ConfigError(f"{where}.{k} must be a bool, got {v!r}")
    if isinstance(default, float) and isinstance(v, int) and not isinstance(v, bool):
      v = float(v)
    if isinstance(default, int) and not isinstance(default, bool) and isinstance(v, float) and v.is_integer():
      v = int(v)
    if default is not None and not isinstance(default, tuple) and type(v) is not type(default):
      raise ConfigError(f"{where}.{k} must be {type(default).__name__}, got {v!r}")
    kwargs[k] = v
  return cls(**kwargs)


def from_dict(d: Mapping[str, Any]) -> Config:
  """Converts a (nested) mapping or ConfigDict into a frozen :class:`Config`; rejects unknown keys."""
  if hasattr(d, "to_dict"):
    d = d.to_dict()
  d = dict(d)
  extras = d.pop("extras", {}) or {}
  unknown = sorted(set(d) - set(_SECTIONS))
  if unknown:
    raise ConfigError(f"unknown config section(s) {unknown}; known: {sorted(_SECTIONS)}")
  kw = {}
  for name, cls in _SECTION_TYPES.items():
    if name in d:
      kw[name] = _build(cls, dict(d[name]), name)
  if "name" in d:
    kw["name"] = str(d["name"])
  if extras:
    kw["extras"] = tuple(sorted((k, _freeze(v)) for k, v in dict(extras).items()))
  return Config(**kw)


def _freeze(v):
  if hasattr(v, "to_dict"):
    v = v.to_dict()
  if isinstance(v, dict):
    return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
  if isinstance(v, list):
    return tuple(_freeze(x) for x in v)
  return v


def extras(cfg: Config, section: str) -> dict:
  """Returns one extras section (e.g. 'resilience') as a plain nested dict."""
  def thaw(v):
    if isinstance(v, tuple) and v and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in v):
      return {k: thaw(x) for k, x in v}
    return v
  return thaw(dict(cfg.extras).get(section, ())) or {}


def to_dict(cfg: Config) -> dict:
  out = dataclasses.asdict(cfg)
  out["extras"] = {k: extras(cfg, k) for k, _ in cfg.extras}
  return out


def resolve_mesh(mesh: MeshConfig, n_devices: int) -> MeshConfig:
  """Fills a single -1 axis and checks the product equals the device count."""
  sizes = mesh.sizes()
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ConfigError(f"at most one mesh axis may be -1, got {free}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if any(s == 0 or s < -1 for s in sizes.values()):
    raise ConfigError(f"mesh axis sizes must be positive or -1, got {sizes}")
  if free:
    if n_devices % fixed:
      raise ConfigError(f"mesh {_fmt(sizes)} cannot fill {n_devices} devices: {fixed} does not divide it")
    sizes[free[0]] = n_devices // fixed
  prod = math.prod(sizes.values())
  if prod != n_devices:
    raise ConfigError(
        f"mesh {_fmt(sizes)} needs {prod} devices, found {n_devices}: change --config.mesh.* so the product is "
        f"{n_devices} (or set one axis to -1), or set XLA_FLAGS=--xla_force_host_platform_device_count={prod} "
        f"before jax starts to emulate {prod} CPU devices")
  return dataclasses.replace(mesh, **{a: sizes[a] for a in MESH_AXES})


def _fmt(sizes):
  return " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "(all 1)"


def validate(cfg: Config, n_devices: int, n_processes: int = 1) -> Config:
  """Checks everything that would otherwise fail deep inside compilation; returns cfg with the mesh resolved."""
  m = cfg.model
  mesh = resolve_mesh(cfg.mesh, n_devices)
  validate_model(m)
  if mesh.form not in ("jit", "shard_map"):
    raise ConfigError(f"mesh.form={mesh.form!r}; choose 'jit' or 'shard_map'")
  if mesh.schedule not in ("gpipe", "1f1b"):
    raise ConfigError(f"mesh.schedule={mesh.schedule!r}; choose 'gpipe' or '1f1b'")
  if mesh.rules == "maxtext" and mesh.form == "shard_map" and mesh.tensor > 1:
    raise ConfigError("mesh.rules='maxtext' shards the residual stream over the tensor axis in the jit form only: "
                      "use --config.mesh.form=jit, or mesh.tensor_sequence_parallel=True in the shard_map form")
  if m.n_heads % m.n_kv_heads:
    raise ConfigError(f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads={m.n_kv_heads}")
  if mesh.form == "shard_map" and m.vocab_size % mesh.tensor:
    pad = -(-m.vocab_size // mesh.tensor) * mesh.tensor
    raise ConfigError(f"model.vocab_size={m.vocab_size} is not divisible by mesh.tensor={mesh.tensor} (the embedding "
                      f"and LM head are vocab-parallel over the tensor axis): pad the vocabulary, e.g. "
                      f"--config.model.vocab_size={pad}, as Megatron's --make-vocab-size-divisible-by does")
  if m.n_kv_heads % mesh.tensor or m.n_heads % mesh.tensor:
    raise ConfigError(
        f"model.n_heads={m.n_heads} / n_kv_heads={m.n_kv_heads} are not divisible by mesh.tensor={mesh.tensor}: "
        f"pick a tensor axis that divides {math.gcd(m.n_heads, m.n_kv_heads)}")
  if m.ff % mesh.tensor and not m.moe:
    raise ConfigError(f"model d_ff={m.ff} is not divisible by mesh.tensor={mesh.tensor}")
  validate_experts(m, mesh)
  if m.n_layers % mesh.pipeline:
    raise ConfigError(f"model.n_layers={m.n_layers} is not divisible by mesh.pipeline={mesh.pipeline} stages: "
                      f"use a pipeline size that divides {m.n_layers}")
  validate_virtual_stages(m, mesh)
  batch_shards = mesh.data * mesh.fsdp * mesh.expert
  if cfg.data.global_batch % batch_shards:
    raise ConfigError(f"data.global_batch={cfg.data.global_batch} is not divisible by the batch axes "
                      f"data x fsdp x expert = {batch_shards}: use a multiple of {batch_shards}")
  if cfg.data.global_batch % n_processes:
    raise ConfigError(f"data.global_batch={cfg.data.global_batch} is not divisible by {n_processes} processes")
  if mesh.pipeline > 1 or mesh.microbatches > 1:
    per = cfg.data.global_batch // batch_shards
    if per % mesh.microbatches:
      raise ConfigError(f"per-replica batch {per} is not divisible by mesh.microbatches={mesh.microbatches}")
  validate_attention(m, cfg.data.seq_len, mesh)
  if cfg.optim.master_weights and m.param_dtype == "float32":
    raise ConfigError("optim.master_weights=True keeps float32 masters of lower-precision parameters, but "
                      "model.param_dtype is float32 (the parameters are their own masters): set "
                      "model.param_dtype=bfloat16, or optim.master_weights=False")
  if cfg.data.seq_len % mesh.sequence:
    raise ConfigError(f"data.seq_len={cfg.data.seq_len} is not divisible by mesh.sequence={mesh.sequence}")
  validate_tensor_sequence_parallel(cfg.data.seq_len, mesh)
  if cfg.data.seq_len > m.max_seq_len:
    raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
  validate_data(cfg.data, m.vocab_size)
  validate_profile_steps(cfg.train.profile_steps)
  return dataclasses.replace(cfg, mesh=mesh)


def validate_experts(m: ModelConfig, mesh: MeshConfig) -> None:
  """Expert parallelism needs experts to split; the experts' width splits over the tensor axis."""
  if mesh.expert > 1 and not m.moe:
    raise ConfigError(f"mesh.expert={mesh.expert} splits the experts of a mixture of experts, but model.n_experts=0: "
                      f"set model.n_experts, or mesh.expert=1")
  if m.moe and m.n_experts % mesh.expert:
    raise ConfigError(f"model.n_experts={m.n_experts} is not divisible by mesh.expert={mesh.expert}: use an expert "
                      f"axis that divides {m.n_experts}")
  if m.moe and m.expert_ff % mesh.tensor:
    raise ConfigError(f"the experts' width {m.expert_ff} (model.moe_d_ff) is not divisible by mesh.tensor={mesh.tensor}")


def validate_data(d: DataConfig, vocab_size: int) -> None:
  """Checks of the data section that need no file (a tokenizer.json's vocabulary is checked when it is read)."""
  if d.format not in DATA_FORMATS:
    raise ConfigError(f"data.format={d.format!r}; choose one of {DATA_FORMATS}")
  if not d.text_key:
    raise ConfigError("data.text_key is empty: name the field (jsonl) or column (parquet) holding the text")
  if d.shuffle_windows < 0:
    raise ConfigError(f"data.shuffle_windows={d.shuffle_windows} must be >= 0 (0: no shuffling)")
  if d.tokenizer == "bytes" and vocab_size < 256:
    raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the byte tokenizer's 256 ids: set "
                      f"--config.model.vocab_size=256 or more")


def validate_profile_steps(steps: tuple) -> None:
  """``train.profile_steps``: empty (no trace) or (START >= 0, COUNT >= 1)."""
  if steps == ():
    return
  if (not isinstance(steps, tuple) or len(steps) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in steps)
      or steps[0] < 0 or steps[1] < 1):
    raise ConfigError(f"train.profile_steps={steps!r} must be START,COUNT (START >= 0, COUNT >= 1), e.g. "
                      f"--config.train.profile_steps=5,3 traces steps 5, 6 and 7")


def validate_tensor_sequence_parallel(seq_len: int, mesh: MeshConfig) -> None:
  """Sequence parallelism of the tensor axis: written out in the shard_map form, over whole local sequences."""
  if not mesh.tensor_sequence_parallel or mesh.tensor == 1:
    return
  if mesh.form != "shard_map":
    raise ConfigError("mesh.tensor_sequence_parallel=True writes its collectives per device: set "
                      "--config.mesh.form=shard_map (the jit form leaves activation layouts to GSPMD)")
  local = seq_len // mesh.sequence
  if local % mesh.tensor:
    raise ConfigError(f"mesh.tensor_sequence_parallel=True splits each device's {local} tokens (data.seq_len / "
                      f"mesh.sequence) over mesh.tensor={mesh.tensor}: use a seq_len whose local length is a "
                      f"multiple of {mesh.tensor}")


def validate_virtual_stages(m: ModelConfig, mesh: MeshConfig) -> None:
  """Interleaved / circular pipelines: v chunks per stage, micro-batches in groups of the stages."""
  v = mesh.virtual_stages
  if v < 1:
    raise ConfigError(f"mesh.virtual_stages={v} must be >= 1 (1 = one chunk of layers per pipeline stage)")
  if v == 1:
    return
  if mesh.pipeline == 1:
    raise ConfigError(f"mesh.virtual_stages={v} needs pipeline stages: set mesh.pipeline > 1 or virtual_stages=1")
  if m.n_layers % (mesh.pipeline * v):
    raise ConfigError(f"model.n_layers={m.n_layers} does not split into mesh.pipeline={mesh.pipeline} x "
                      f"virtual_stages={v} equal chunks: use virtual_stages dividing {m.n_layers // mesh.pipeline}")
  if mesh.microbatches % mesh.pipeline:
    raise ConfigError(f"mesh.virtual_stages={v} runs micro-batches in groups of mesh.pipeline={mesh.pipeline}: set "
                      f"mesh.microbatches to a multiple of {mesh.pipeline} (got {mesh.microbatches})")
  if not m.scan_layers:
    raise ConfigError("mesh.virtual_stages > 1 stores the scanned layer stack in chunks: set model.scan_layers=True")


def validate_attention(m: ModelConfig, seq_len: int, mesh: MeshConfig) -> None:
  """Sequence-length and layout constraints of the attention kernel (seq_len: training length)."""
  if m.attention == "ring" and mesh.sequence > 1 and seq_len % (2 * mesh.sequence):
    raise ConfigError(f"model.attention='ring' splits the sequence into 2 x mesh.sequence = {2 * mesh.sequence} "
                      f"zig-zag chunks: data.seq_len={seq_len} must be a multiple of {2 * mesh.sequence}")
  if m.attention == "ring" and mesh.sequence > 1 and mesh.pipeline > 1 and mesh.form == "shard_map":
    # A ppermute over 'sequence' is one collective-permute over every device; inside a pipeline slot only the
    # busy stage runs it, and XLA waits for all (observed: a hang or garbage on CPU).
    raise ConfigError("model.attention='ring' cannot run inside pipeline stages (its K/V ppermute would wait for "
                      "idle stages): use model.attention='blockwise' (all-gathered K/V) with mesh.pipeline > 1, "
                      "or mesh.pipeline=1")
  if m.attention in ("blockwise", "splash", "ring") and seq_len > m.attention_block and seq_len % m.attention_block:
    raise ConfigError(f"model.attention_block={m.attention_block} does not divide data.seq_len={seq_len}: "
                      f"use a divisor of {seq_len} (e.g. {_largest_divisor(seq_len, m.attention_block)})")
  if m.attention == "splash" and (seq_len % 128 or min(m.attention_block, seq_len) % 128):
    raise ConfigError(f"model.attention='splash' tiles by multiples of 128 (TPU lanes): data.seq_len={seq_len} "
                      f"and model.attention_block={m.attention_block} must be multiples of 128")
  if m.attention == "splash" and (mesh.form != "jit" or mesh.pipeline > 1):
    raise ConfigError("model.attention='splash' runs in mesh.form='jit' without pipeline stages (a Pallas kernel "
                      "cannot be typed inside the shard_map forms): set mesh.form=jit and mesh.pipeline=1, or "
                      "use model.attention='blockwise'")
  if m.attention == "splash" and mesh.sequence > 1:
    raise ConfigError("model.attention='splash' does not support mesh.sequence > 1 (its causal mask assumes "
                      "queries and keys start together): use model.attention='blockwise' or mesh.sequence=1")
  if m.attention == "cudnn" and (m.hd > 128 or m.hd % 8):
    raise ConfigError(f"model.attention='cudnn' needs a head dim <= 128 and a multiple of 8 (cuDNN's flash kernel), "
                      f"got {m.hd}: use model.attention='dot_product' or 'blockwise'")
  if m.attention == "cudnn" and m.dtype not in ("bfloat16", "float16"):
    raise ConfigError(f"model.attention='cudnn' needs 16-bit compute, got model.dtype={m.dtype!r}: set "
                      f"model.dtype=bfloat16 (or use model.attention='dot_product')")


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)
