"""How a published row becomes a PrismLLM config: what the row ran (facts with sources), then config keys.

Written before any row was re-scored, from the rows' columns, their notes and the frameworks' documented defaults;
no rule reads an error (perfmodel/README.md, 'Mapping rules'). Three parts:

* :func:`row_features`: the row as facts (:class:`Fact`: value + source) for each feature the frameworks run:
  optimizer-state sharding (ZeRO-1 / distributed optimizer), fp32 master weights, pipeline schedule and virtual
  stages, recompute, context parallelism, matmul precision, communication overlap, layers per program;
* :data:`FEATURE_KEYS` / :func:`features_to_overrides`: the one table from facts to config keys. A key this
  checkout's Config does not have raises :class:`FeaturePathMissing` (a ConfigError naming the feature and the key),
  and the row is reported ``not compiled: <feature> path missing``: never silently compiled without the feature;
* :func:`row_config`: the row's full override list (architecture, layout, attention kernel, features), its TPU
  topology and the notes that say where the program differs from the row.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from framework import config as config_lib
from framework.config import ConfigError
from perfmodel.calib import published as P


@dataclasses.dataclass(frozen=True)
class Fact:
  value: object
  source: str


class FeaturePathMissing(ConfigError):
  """A feature the row ran whose config key (or value) this checkout does not have."""

  def __init__(self, feature: str, detail: str):
    super().__init__(f"{feature} path missing: {detail}")
    self.feature = feature


FAMILIES = ((r"^MaxText", "maxtext"), (r"^Paxml", "paxml"), (r"^Megatron-LM \(20", "megatron_2021"),
            (r"^Megatron-Core", "megatron_core"), (r"^NeMo Automodel", "automodel"),
            (r"^(NeMo|Megatron-Bridge)", "nemo"), (r"^torchtitan", "torchtitan"),
            (r"^llm-foundry", "llmfoundry"), (r"^Llama 3", "llama3"), (r"^Megatron-LM @", "megatron_megascale"),
            (r"^MegaScale", "megascale"))

# framework facts the rows' own columns do not carry, each with where it is written down
SRC = {
    "maxtext_opt": "MaxText: the optimizer state takes the parameters' sharding (fsdp / tensor mesh axes) and is "
                   "replicated over the data axis (maxtext_utils.get_abstract_state)",
    "paxml_opt": "Paxml/Praxis: optimizer state sharded like the variables over the fsdp mesh axes, replicated over "
                 "the data axis",
    "fsdp_opt": "FSDP (framework column): parameters, gradients and optimizer state sharded over the fsdp ranks",
    "torchtitan_fsdp_cp": "torchtitan applies FSDP2 over the flattened 'dp_shard_cp' mesh (dp_shard x cp): "
                          "parameters, gradients and optimizer state sharded over the context-parallel ranks too "
                          "(torchtitan/models/llama3/infra/parallelize.py)",
    "megatron_2021_opt": "Megatron-LM of these papers (2021-22): data-parallel ranks each hold the full optimizer "
                         "state (no distributed optimizer in these runs)",
    "megatron_core_opt": "row notes: --overlap-param-gather, which Megatron accepts only with "
                         "--use-distributed-optimizer (megatron/training/arguments.py validate_args)",
    "nemo_opt": "NeMo / Megatron-Bridge default optimizer recipe distributed_fused_adam_with_cosine_annealing: "
                "use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True "
                "(nemo/collections/llm/recipes/optim/adam.py)",
    "automodel_opt": "NeMo Automodel trains with PyTorch FSDP2 (CSV framework): parameters, gradients and optimizer "
                     "state sharded over the FSDP ranks; where the expert axis takes those ranks, ZeRO-1 over the "
                     "batch axes (data x expert) keeps the optimizer state sharded",
    "llama3_opt": "Llama 3 paper Sec. 3.3.2: FSDP shards optimizer states and gradients; parameters are not "
                  "resharded after forward",
    "megascale_opt": "MegaScale paper Fig. 1 and Sec. 2: ZeRO-2 data parallelism (optimizer state and gradients "
                     "sharded)",
    "megatron_default_opt": "not stated in the source: Megatron-LM's default (no --use-distributed-optimizer)",
    "params_master": "parameters held in fp32 and cast to bf16 for compute (MaxText weight_dtype float32, Praxis "
                     "fp32 variables, FSDP mixed precision keeps fp32 sharded parameters)",
    "megatron_master": "Megatron mixed precision: 16-bit model parameters with fp32 main parameters in the optimizer "
                       "(megatron/core/optimizer Float16OptimizerWithFloat16Params / DistributedOptimizer)",
    "llama3_master": "Llama 3 paper Sec. 3.3.2: bf16 compute copies kept after forward (no reshard), gradients "
                     "accumulated and reduce-scattered in FP32; FSDP keeps the fp32 master shards",
    "megatron_1f1b": "Megatron default without virtual stages: 1F1B that stashes activations "
                     "(forward_backward_pipelining_without_interleaving); recompute only as configured",
    "torchtitan_1f1b": "torchtitan pipeline_parallel_schedule default '1F1B'",
    "interleaved_v": "interleaved, chunks per rank not published: 2 (torchtitan's default for multi-stage "
                     "schedules), or the smallest count >= 2 that divides the layers per stage",
    "megatron_cp": "Megatron --cp-comm-type default 'p2p': ring exchange of K/V (megatron/training/arguments.py)",
    "torchtitan_cp": "torchtitan context_parallel_rotate_method default 'allgather'",
    "llama3_cp": "Llama 3 paper Sec. 3.3.2: all-gather based context parallelism (K/V all-gathered)",
    "llama3_overlap": "Llama 3 paper Sec. 3.3.2: FSDP prefetches weights and reduces gradients asynchronously",
    "megatron_sp": "Megatron-LM: --tp-comm-overlap is accepted only with --sequence-parallel "
                   "(megatron/training/arguments.py); the row's notes name the flag",
    "nemo_sp": "NeMo / Megatron-Bridge performance recipes set sequence_parallel=True whenever "
               "tensor_model_parallel_size > 1",
    "megascale_sp": "MegaScale paper Sec. 3.2: tensor / sequence parallelism with their communication overlapped; "
                    "its Megatron-LM baseline runs the same parallel configuration (Table 2)",
    "torchtitan_sp": "torchtitan's tensor-parallel plan shards the norms and the activations between blocks along "
                     "the sequence (SequenceParallel in parallelize_llama)",
    "maxtext_sp": "MaxText logical_axis_rules ['activation_embed', 'tensor'] (MaxText/configs/base.yml): the "
                  "residual stream between blocks is sharded along its embed dim over the tensor axis",
    "recompute_rule": "recompute not published: 'minimal_flash' (Megatron's default keeps every activation: the "
                      "matmul outputs and the flash kernel's output and softmax statistics are kept, only "
                      "elementwise work is recomputed; the flash backward recomputes its scores itself)",
}


def family(r: P.PublishedRun) -> Optional[str]:
  for pat, name in FAMILIES:
    if re.search(pat, r.framework):
      return name
  return None


def _virtual(layers: int, stages: int) -> int:
  """Chunks per rank when the source says interleaved but not how many: 2 (torchtitan's default), else the
  smallest count >= 2 that divides the layers per stage (1 when a stage holds one layer)."""
  if layers % stages:
    return 2  # the layers do not split evenly: the config check reports it
  per = layers // stages
  return next((v for v in range(2, per + 1) if per % v == 0), 1)


def row_features(r: P.PublishedRun) -> dict:
  """{feature: Fact} of what the row ran. Raises ConfigError for a framework without rules."""
  fam = family(r)
  if fam is None:
    raise ConfigError(f"row {r.id}: no mapping rules for framework '{r.framework}' "
                      f"(add it to FAMILIES in perfmodel/calib/published_mapping.py)")
  f = {}
  # optimizer state sharded over the data-parallel ranks (ZeRO-1 / distributed optimizer)?
  opt = {"maxtext": ("fsdp", SRC["maxtext_opt"]), "paxml": ("fsdp", SRC["paxml_opt"]),
         "torchtitan": ("fsdp", SRC["fsdp_opt"]), "llmfoundry": ("fsdp", SRC["fsdp_opt"]),
         "automodel": ("data", SRC["automodel_opt"]),
         "megatron_2021": ("none", SRC["megatron_2021_opt"]), "megatron_core": ("data", SRC["megatron_core_opt"]),
         "nemo": ("data", SRC["nemo_opt"]), "llama3": ("data", SRC["llama3_opt"]),
         "megatron_megascale": ("none", SRC["megatron_default_opt"]), "megascale": ("data", SRC["megascale_opt"])}[fam]
  if fam == "nemo" and r.fsdp > 1:
    opt = ("fsdp", f"CSV fsdp = {r.fsdp} (Megatron FSDP): state sharded with the parameters")
  if fam == "automodel" and r.fsdp > 1 and r.expert == 1:
    opt = ("fsdp", SRC["fsdp_opt"])
  if fam == "torchtitan" and r.sequence > 1:
    opt = ("fsdp_cp", SRC["torchtitan_fsdp_cp"])
  shardable = r.data * r.expert > 1  # the expert axis splits the batch as data does (ZeRO-1 shards over both)
  f["optimizer_sharding"] = Fact(opt[0] if shardable or opt[0] in ("fsdp", "fsdp_cp") else "none",
                                 opt[1] + ("" if shardable else "; CSV dp = 1: nothing to shard over"))
  megatron_like = fam in ("megatron_2021", "megatron_core", "nemo", "megatron_megascale", "megascale")
  f["master_weights"] = (Fact("f32", SRC["megatron_master"]) if megatron_like else
                         Fact("f32", SRC["llama3_master"]) if fam == "llama3" else Fact("params", SRC["params_master"]))
  # layers the program runs: uneven first / last stages (one layer fewer each) run as the interior stages' count
  layers, v_stated = r.n_layers, r.virtual_stages
  uneven = r.pipeline > 1 and "one transformer layer fewer" in r.notes.lower()
  if uneven:
    layers = r.n_layers + 2
  ragged = r.pipeline > 1 and not uneven and layers % r.pipeline != 0
  if ragged:
    layers = -(-layers // r.pipeline) * r.pipeline
  f["program_layers"] = Fact(layers, "CSV notes: first and last stages hold one layer fewer; every stage runs the "
                             "interior stages' layer count (model FLOPs and the baseline count the row's layers)"
                             if uneven else f"CSV n_layers {r.n_layers} do not split over {r.pipeline} stages: every "
                             f"stage runs the largest stage's {layers // r.pipeline} layers (the slowest stage sets a "
                             f"pipeline's pace; model FLOPs and the baseline count the row's layers)" if ragged
                             else "CSV n_layers")
  interleaved_text = "interleaved" in r.notes.lower() and r.pipeline > 1
  if r.pipeline == 1:
    f["schedule"], f["virtual_stages"] = Fact("none", "CSV pp = 1"), Fact(1, "CSV pp = 1")
  elif fam == "maxtext":
    f["schedule"] = Fact("circular", "MaxText pipeline: circular (num_pipeline_repeats)")
    f["virtual_stages"] = Fact(_virtual(layers, r.pipeline), SRC["interleaved_v"])
  elif v_stated > 1:
    f["schedule"], f["virtual_stages"] = Fact("interleaved", "CSV vpp"), Fact(v_stated, "CSV vpp")
  elif v_stated == 0 or (interleaved_text and "interleaving m=" not in r.notes.lower()) or fam == "llama3":
    why = "CSV vpp: interleaved" if v_stated == 0 else "CSV notes / source: interleaved schedule"
    v = _virtual(layers, r.pipeline)
    f["schedule"] = Fact("interleaved" if v > 1 else "1f1b", why)
    f["virtual_stages"] = Fact(v, SRC["interleaved_v"])
  else:
    f["schedule"] = Fact("1f1b", SRC["torchtitan_1f1b"] if fam == "torchtitan" else SRC["megatron_1f1b"])
    f["virtual_stages"] = Fact(1, "CSV vpp empty")
  if r.remat is None:
    f["recompute"] = Fact("minimal_flash", SRC["recompute_rule"] + (f" (CSV: '{r.recompute_raw}')" if r.recompute_raw
                                                              else ""))
  else:
    f["recompute"] = Fact(r.remat, f"CSV recompute '{r.recompute_raw}'"
                          + ("" if r.remat_exact else f" (nearest policy '{r.remat}')"))
  if r.sequence == 1:
    f["context_parallel"] = Fact("none", "CSV cp = 1")
  elif megatron_like and r.pipeline > 1:
    f["context_parallel"] = Fact("ring_in_pipeline", SRC["megatron_cp"] + "; ring attention inside pipeline stages "
                                 "is not built (parallelism/README.md, Limits): K/V all-gathered over the cp ranks")
  elif megatron_like:
    f["context_parallel"] = Fact("ring", SRC["megatron_cp"])
  elif fam == "torchtitan":
    f["context_parallel"] = Fact("all_gather", SRC["torchtitan_cp"])
  elif fam == "llama3":
    f["context_parallel"] = Fact("all_gather", SRC["llama3_cp"])
  else:
    raise ConfigError(f"row {r.id}: cp = {r.sequence} without a context-parallel rule for '{r.framework}'")
  if r.tensor == 1:
    f["sequence_parallel"] = Fact(False, "CSV tp = 1")
  elif fam == "megatron_2021":
    sp = "sequence parallel" in (r.recompute_raw or "").lower()
    f["sequence_parallel"] = Fact(sp, "CSV recompute names sequence parallelism (Korthikanti et al. 2022)" if sp else
                                  "Megatron-LM of 2021 and the 2022 paper's baselines: no sequence parallelism")
  elif fam == "megatron_core":
    f["sequence_parallel"] = Fact("--tp-comm-overlap" in r.notes or "--sequence-parallel" in r.notes,
                                  SRC["megatron_sp"])
  elif fam == "maxtext" and r.pipeline == 1:
    f["sequence_parallel"] = Fact("embed", SRC["maxtext_sp"])
  elif fam in ("nemo", "megascale", "megatron_megascale", "torchtitan"):
    f["sequence_parallel"] = Fact(True, SRC[{"nemo": "nemo_sp", "torchtitan": "torchtitan_sp"}.get(fam,
                                                                                                  "megascale_sp")])
  else:
    f["sequence_parallel"] = Fact(False, "not stated in the source" if fam == "llama3" else
                                  "XLA's partitioner lays out the activations (jit form)")
  f["matmul_precision"] = Fact("fp8" if r.precision == "fp8" else "bf16", f"CSV precision '{r.precision}'")
  overlap, src = (), ""
  if fam == "megatron_core":
    overlap = tuple(k for k, flag in (("grad_reduce", "--overlap-grad-reduce"),
                                      ("param_gather", "--overlap-param-gather"), ("tp_comm", "--tp-comm-overlap"))
                    if flag in r.notes)
    src = "CSV notes (Megatron flags)"
  elif fam == "nemo" and r.data * r.expert > 1:
    overlap, src = ("grad_reduce", "param_gather"), SRC["nemo_opt"]
  elif fam == "llama3":
    overlap, src = ("grad_reduce", "param_gather"), SRC["llama3_overlap"]
  elif fam == "torchtitan" and re.search(r"async ?tp", r.framework + " " + r.notes, re.I):
    overlap, src = ("tp_comm",), "CSV: async TP"
  f["overlap"] = Fact(overlap, src or "none stated: what XLA's scheduler does for the target")
  return f


# ------------------------------------------------------------------------------------------------ translation
# THE TABLE TO ADAPT WHEN A FEATURE'S CONFIG KEY CHANGES: fact value -> {"section.key": value}. {} = the program
# does this without a key. A key set to None is declared not modelled: the row compiles without it and says so.
FEATURE_KEYS = {
    "optimizer_sharding": {"data": {"optim.shard_optimizer_state": True}, "fsdp": {},
                           "fsdp_cp": {"mesh.rules": "fsdp_sequence"}, "none": {}},
    "master_weights": {"f32": {"optim.master_weights": True, "model.param_dtype": "bfloat16"},
                       "params": {"model.param_dtype": "float32"}},
    # 1f1b stashes activations; with virtual stages 1f1b is Megatron's interleaved 1F1B, gpipe MaxText's circular
    "schedule": {"none": {}, "1f1b": {"mesh.schedule": "1f1b"}, "interleaved": {"mesh.schedule": "1f1b"},
                 "circular": {"mesh.schedule": "gpipe"}},
    "virtual_stages": {"key": "mesh.virtual_stages"},  # set when > 1
    # sequence > 1 all-gathers K/V with any attention kernel: all_gather needs no key
    "context_parallel": {"none": {}, "ring": {"model.attention": "ring"}, "all_gather": {},
                         "ring_in_pipeline": {"model.attention": None}},
    "matmul_precision": {"bf16": {}, "fp8": {"model.matmul_precision": "fp8"}},
    "sequence_parallel": {False: {}, True: {"mesh.tensor_sequence_parallel": True, "mesh.form": "shard_map"},
                          "embed": {"mesh.rules": "maxtext"}},
    "recompute": {"key": "model.remat"},
    "program_layers": {"key": "model.n_layers"},
}


def _known_keys() -> set:
  cfg = config_lib.Config()
  return {f"{s.name}.{k.name}" for s in dataclasses.fields(cfg)
          if dataclasses.is_dataclass(getattr(cfg, s.name)) for k in dataclasses.fields(getattr(cfg, s.name))}


def feature_pairs(name: str, fact: Fact) -> dict:
  """{"section.key": value} one fact asks for (FEATURE_KEYS)."""
  if name == "overlap":
    return {}  # not a config key: the framework spec's options (:func:`framework_spec`)
  table = FEATURE_KEYS[name]
  if "key" in table:
    return {table["key"]: fact.value} if name != "virtual_stages" or fact.value > 1 else {}
  return dict(table[fact.value])


# family -> the framework predict prices the step as (parallelism/target_flags.py): its XLA flags for the target;
# the overlap options are the row's ``overlap`` fact. Meta's Llama 3 stack and MegaScale are PyTorch / Megatron.
FRAMEWORK_OF = {"automodel": "torchtitan", "maxtext": "maxtext", "paxml": "paxml", "megatron_2021": "megatron", "megatron_core": "megatron",
                "nemo": "nemo", "torchtitan": "torchtitan", "llmfoundry": "llm-foundry", "llama3": "torchtitan",
                "megatron_megascale": "megatron", "megascale": "megatron"}


def framework_spec(r: P.PublishedRun, features: dict) -> str:
  """``predict --framework`` for the row: the framework and the overlap options it ran (``name:none`` when none)."""
  return f"{FRAMEWORK_OF[family(r)]}:{','.join(features['overlap'].value) or 'none'}"


def features_to_overrides(features: dict) -> dict:
  """{"section.key": value} for the row's facts (:data:`FEATURE_KEYS`). Raises FeaturePathMissing for a key this
  checkout's Config does not have."""
  known, out = _known_keys(), {}
  for name, fact in features.items():
    for key, value in feature_pairs(name, fact).items():
      if value is None:
        continue
      if key not in known:
        raise FeaturePathMissing(name, f"config key {key} (= {value!r}, for {name} = {fact.value!r}) is not in this "
                                       f"checkout's Config; adapt FEATURE_KEYS in perfmodel/calib/published_mapping.py")
      out[key] = value
  return out


# ------------------------------------------------------------------------------------------------ the row's config

@dataclasses.dataclass
class RowMapping:
  overrides: list  # --config.<section>.<key>=<value>, the predict contract's command-line form
  topology: Optional[str]
  notes: list  # where the program differs from the row
  features: dict  # {feature: Fact}
  framework: str = ""  # predict --framework: XLA flags and overlap options (framework_spec)
  error: str = ""  # 'not compiled: ...' when a feature has no path in this checkout


def _slices(r: P.PublishedRun) -> int:
  m = re.search(r"across (\d+) slice", r.notes)
  return int(m.group(1)) if m else 1


def _attention(r: P.PublishedRun, notes: list) -> str:
  tpu = r.hardware.startswith("tpu")
  if tpu and r.pipeline == 1 and r.sequence == 1 and r.seq_len % 128 == 0 and not r.n_experts:
    return "splash"
  if tpu:
    notes.append("attention blockwise: the layout (pipeline / context parallel / experts: shard_map form) rules out "
                 "the splash kernel")
    return "blockwise"
  if r.head_dim <= 128 and r.head_dim % 8 == 0:
    return "cudnn"
  notes.append(f"attention dot_product (XLA): head dim {r.head_dim} is outside cuDNN flash attention's (<= 128)")
  return "dot_product"


def _experts(r: P.PublishedRun, notes: list) -> dict:
  """The MoE keys of a row. Rule (written before any MoE row was priced): every row runs the capacity dispatch
  (framework/moe.py ``capacity``: per-expert buffers of C slots, all_to_all over the expert axis), at the row's
  capacity factor when it drops tokens, else at 1.0: a dropless run whose router is balanced (forced-balanced
  benchmarks, or the balance loss at work) gives every expert A / E assignments, the work of C = A / E slots;
  grouped GEMMs (megablox, TE) run exactly that. XLA's own ragged dot is not what those frameworks run (on GPU it
  lowers to a dense product over every local expert). The step is the shard_map form (two all_to_all per layer),
  as Megatron's and MaxText's MoE layers are explicit per-device code: the jit form's dispatch sorts the global
  batch, which GSPMD all-gathers."""
  cf = r.capacity_factor or 1.0
  notes.append(f"experts: capacity dispatch at factor {cf:g}" + ("" if r.capacity_factor else
                                                                 " (dropless, balanced routing assumed)"))
  if r.first_dense_layers:
    notes.append(f"first {r.first_dense_layers} dense layers run as MoE layers")
  return dict(n_experts=r.n_experts, experts_per_token=r.experts_per_token, moe_d_ff=r.moe_d_ff,
              n_shared_experts=r.n_shared_experts, router=r.router, moe_impl="capacity", capacity_factor=cf)


def row_config(r: P.PublishedRun) -> RowMapping:
  """The row's overrides (base config ``P.BASE_CONFIG``), TPU topology and notes; ``error`` set, not raised, when
  a feature the row ran has no path in this checkout."""
  from parallelism import targets  # noqa: PLC0415 (planning only: no compiler is loaded)
  notes = []
  features = row_features(r)
  layers = features["program_layers"].value
  model = dict(n_layers=layers, d_model=r.d_model, n_heads=r.n_heads, n_kv_heads=r.n_kv_heads,
               head_dim=r.head_dim, d_ff=r.d_ff, vocab_size=r.vocab_size, max_seq_len=r.seq_len,
               remat=features["recompute"].value, mlp=r.mlp, tie_embeddings=r.tie_embeddings,
               attention=_attention(r, notes), attention_block=512 if r.seq_len % 512 == 0 else r.seq_len,
               block="parallel" if r.parallel_block else "sequential", dtype="bfloat16", param_dtype="float32",
               scan_layers=True)
  if r.n_experts:
    model.update(_experts(r, notes))
  micro = r.microbatches or 1
  if r.pipeline > 1 and r.microbatches == 0:
    micro = max(1, r.global_batch // max(1, r.data * r.fsdp))
    notes.append(f"micro-batch size not published: {micro} pipeline micro-batches of one sequence")
  pipelined_or_cp = r.pipeline > 1 or r.sequence > 1
  mesh = dict(data=r.data, fsdp=r.fsdp, tensor=r.tensor, pipeline=r.pipeline, sequence=r.sequence,
              expert=r.expert, microbatches=micro, form="shard_map" if pipelined_or_cp or r.n_experts else "jit", schedule="1f1b")
  flat = {f"model.{k}": v for k, v in model.items()}
  flat.update({"data.seq_len": r.seq_len, "data.global_batch": r.global_batch})
  flat.update({f"mesh.{k}": v for k, v in mesh.items()})
  error = ""
  try:
    flat.update(features_to_overrides(features))
  except FeaturePathMissing as e:
    error = f"not compiled: {e}"
  if r.parallel_block:
    notes.append("parallel attention+MLP block (model.block=parallel)")
  if r.biases or r.learned_positions:
    notes.append("biases / learned positions left out")
  if not r.remat_exact and r.remat is not None:
    notes.append(f"recompute '{r.recompute_raw}' as the nearest policy '{r.remat}'")
  if r.remat is None:
    notes.append(f"recompute '{r.recompute_raw or 'not published'}': minimal_flash")
  for name in ("schedule", "context_parallel"):
    if features[name].value not in ("none",):
      notes.append(f"{name} {features[name].value}: {features[name].source}")
  if features["sequence_parallel"].value:
    notes.append(f"sequence parallel: {features['sequence_parallel'].source}")
  if features["overlap"].value:
    notes.append(f"overlap {'+'.join(features['overlap'].value)}: {features['overlap'].source}")
  ov = [f"--config.{k}={v}" for k, v in flat.items()] + [f"--config.name={r.id}"]
  k = _slices(r)
  topology = targets.plan(r.hardware, r.n_chips // k).topology if r.hardware.startswith("tpu") and k > 1 else None
  if topology:
    notes.append(f"{k} slices of {topology} over the data-center network")
  if not error:
    error = _validate(r, ov, features)
  return RowMapping(ov, topology, notes, features, framework_spec(r, features), error)


def build_config(overrides: list, n_chips: int):
  """The config a row's predict child builds: the base config file with the overrides, validated for the chips."""
  from framework import config_file  # noqa: PLC0415
  cfg = config_file.load(os.path.join(P.ROOT, P.BASE_CONFIG), overrides)
  return config_lib.validate(cfg, n_chips)


def _validate(r: P.PublishedRun, overrides: list, features: dict) -> str:
  """'' or why the config does not build: a feature value this checkout refuses names that feature."""
  try:
    build_config(overrides, r.n_chips)
  except ConfigError as e:
    msg = str(e)
    for name, fact in features.items():
      if name in ("recompute", "program_layers", "master_weights"):
        continue  # keys the base program always sets: their errors are the mapping's
      if any(f"{k}=" in msg or f"{k} " in msg for k in feature_pairs(name, fact)):
        return f"not compiled: {name} path missing: {msg}"
    return f"mapping: {msg}"
  return ""
