"""Published, measured LLM training throughput as typed rows with a measured step time in seconds.

``load(path)`` reads ``benchmarks/data/published_training.csv`` (its sources and caveats:
``benchmarks/data/published_training.md``) into :class:`PublishedRun` rows. Each row carries the architecture it ran
(PrismLLM key names, :meth:`PublishedRun.overrides`), its layout, the hardware profile of its chip, its split
(``design`` or ``heldout``, :func:`heldout_rule`, committed in ``benchmarks/data/published_split.csv``) and
``measured_step_s``: the row's metric converted with *that row's* FLOP convention:

  seconds / step, seconds / iteration   taken as is
  tokens/s per chip                     global_batch * seq_len / (value * n_chips)
  model TFLOP/s per chip                flops_per_step(convention) / (value * 1e12 * n_chips)
  MFU                                   flops_per_step(convention) / (value * n_chips * bf16 peak of the chip)

FLOP conventions (:func:`flops_per_step`, global FLOPs of one optimizer step, B sequences of S tokens, L layers,
width d, H query heads of size hd, kv heads K, MLP width f, vocabulary V):

  maxtext_6n_causal   MaxText calculate_training_tflops (@76bd53b0f, same at @efb6d9e4a):
                      6 * N_all * B * S + 6 * L * H * hd * S^2 * B  (attention halved for causality)
  megatron            Megatron-LM num_floating_point_operations (also NeMo's model FLOPs):
                      12 B S L d^2 ((1 + K/H + S/d) H hd / d + g f / d + V / (2 L d)), g = 3/2 for gated MLPs;
                      = 72 B S L d^2 (1 + S/6d + V/12Ld) for GPT (Korthikanti et al. MFU)
  narayanan_hfu       Narayanan et al. SC21 eq. 3, counts the recompute forward:
                      96 B S L d^2 (1 + S/6d + V/16Ld)
  llmfoundry          llm-foundry MPT flops_per_batch: B (6 N_all S + 12 L d S^2)  (non-causal attention)
  torchtitan          torchtitan get_num_flop_per_token: B S (6 N + 12 L H hd S); N counts the embedding too (the
                      64-GPU A100 table's MFUs reproduce with N_all, not with the non-embedding count)
  paxml_6n_full       no formula published with the rows; 6 N_all B S + 12 L H hd S^2 B reproduces the published
                      GPT-5B MFU (tied embedding and learned positions counted)
  palm                Chowdhery et al. (PaLM, App. B) model FLOPs, the Llama 3 paper's MFU: B S (6 N + 12 L H hd S)
                      (N_all: the paper does not restate N's scope; the embeddings are ~1% of the 405B model)
N_all counts every parameter the model holds (embeddings once when tied). Nothing here is fitted to the rows.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import math
import os
import re
from typing import Optional

from perfmodel import hardware

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the config file a row's predict starts from, read as data: the row's overrides set every field that matters
BASE_CONFIG = "experiments/configs/llama3_70b.py"
DATA_DIR = os.path.join(ROOT, "benchmarks", "data")
DEFAULT_CSV = os.path.join(DATA_DIR, "published_training.csv")
SPLIT_CSV = os.path.join(DATA_DIR, "published_split.csv")


def default_path() -> str:
  """The committed rows: ``benchmarks/data/published_training.csv``."""
  return DEFAULT_CSV


REMAT_NAMES = ("full", "minimal", "minimal_flash", "save_qkv_proj", "save_dot_except_mlp", "qkv_proj_offloaded", "none")
CONVENTIONS = ("maxtext_6n_causal", "megatron", "narayanan_hfu", "llmfoundry", "torchtitan", "paxml_6n_full", "palm")


@dataclasses.dataclass(frozen=True)
class PublishedRun:
  id: str
  source: str
  source_key: str  # the publication (source text without row / script details)
  table: str  # source_key | chip column | precision: one published table, the unit of ranking (Kendall tau)
  framework: str
  model: str
  # architecture
  n_layers: int
  d_model: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  vocab_size: int
  mlp: str  # swiglu | gelu | relu
  tie_embeddings: bool
  parallel_block: bool  # attention and MLP read the same normed input (MaxText 2023 synthetic models)
  learned_positions: bool
  biases: bool
  seq_len: int
  global_batch: int  # sequences per optimizer step (0 = not published)
  remat: Optional[str]  # one of REMAT_NAMES; None = not published / no equivalent
  remat_exact: bool  # False when remat is the nearest MaxText-style name, not the same policy
  recompute_raw: str
  dtype: str  # compute dtype: bfloat16 (bf16 and fp16 16-bit rows), float8, int8
  precision: str  # bf16 | fp16 | fp8 | int8
  # layout
  data: int
  fsdp: int
  tensor: int
  pipeline: int
  sequence: int
  micro_batch: int  # sequences per micro-batch per data-parallel rank (0 = not published)
  microbatches: int  # micro-batches per step per rank: pipeline micro-batches or gradient accumulation (0 = unknown)
  virtual_stages: int  # interleaved pipeline chunks per rank (1 = none; 0 = interleaved, count not published)
  # hardware and measurement
  chip: str
  hardware: Optional[str]  # perfmodel/profiles/<name>.json
  hardware_caveat: str
  n_chips: int
  metric: str
  value: float
  convention: Optional[str]  # FLOP convention of the row's metric (CONVENTIONS)
  measured_step_s: Optional[float]
  included: bool
  exclude_reason: str
  caveats: tuple = ()
  notes: str = ""
  split: str = "heldout"  # design | heldout (heldout_rule, benchmarks/data/published_split.csv)
  split_why: str = ""
  # mixture of experts (published_moe_training.csv; 0 = a dense row)
  n_experts: int = 0
  experts_per_token: int = 0
  moe_d_ff: int = 0  # one expert's FFN width
  n_shared_experts: int = 0
  first_dense_layers: int = 0  # leading dense layers (DeepSeek-V3: 3), d_ff wide
  expert: int = 1  # expert-parallel degree
  capacity_factor: float = 0.0  # > 0: capacity routing (tokens dropped beyond it); 0: dropless
  router: str = "softmax"

  @property
  def tokens_per_step(self) -> int:
    return self.global_batch * self.seq_len

  def overrides(self) -> dict:
    """The run as PrismLLM config overrides (``mlp`` and the MaxText-style ``remat`` name are not ModelConfig keys
    of every branch yet)."""
    return {"model": {"n_layers": self.n_layers, "d_model": self.d_model, "n_heads": self.n_heads,
                      "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "d_ff": self.d_ff,
                      "vocab_size": self.vocab_size, "mlp": self.mlp, "tie_embeddings": self.tie_embeddings,
                      "max_seq_len": self.seq_len, "dtype": self.dtype, "remat": self.remat},
            "data": {"seq_len": self.seq_len, "global_batch": self.global_batch},
            "mesh": {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "pipeline": self.pipeline,
                     "sequence": self.sequence, "microbatches": self.microbatches}}


# ------------------------------------------------------------------------------------------------ parameters, FLOPs

def ffn_width(r: PublishedRun, active: bool = True) -> float:
  """Mean FFN width per layer: d_ff for a dense row; with experts, the routed (``active``) or all experts plus the
  shared ones, and the leading dense layers at d_ff."""
  if not r.n_experts:
    return float(r.d_ff)
  moe = ((r.experts_per_token if active else r.n_experts) + r.n_shared_experts) * r.moe_d_ff
  dense = min(r.first_dense_layers, r.n_layers)
  return (dense * r.d_ff + (r.n_layers - dense) * moe) / r.n_layers


def n_params(r: PublishedRun, active: bool = False) -> int:
  """Every parameter of the model the row ran (embedding once when tied; biases and learned positions if any);
  ``active``: only the experts a token is routed to (the count MoE FLOP conventions use), plus the router."""
  d, h, kv, hd, f, L, V = r.d_model, r.n_heads, r.n_kv_heads, r.head_dim, ffn_width(r, active), r.n_layers, \
      r.vocab_size
  attn = d * h * hd * 2 + d * kv * hd * 2  # q, o; k, v
  mlp = d * f * (3 if r.mlp == "swiglu" else 2) + (d * r.n_experts * (L - min(r.first_dense_layers, L)) / L
                                                   if r.n_experts else 0)
  norms = d * (1 if r.parallel_block else 2)
  bias = (h * hd + 2 * kv * hd + d + f * (2 if r.mlp == "swiglu" else 1) + d) if r.biases else 0
  if r.biases:
    norms *= 2  # LayerNorm scale and offset
  n = L * (attn + mlp + norms + bias) + d * (2 if r.biases else 1)
  n += V * d * (1 if r.tie_embeddings else 2)
  if r.learned_positions:
    n += r.seq_len * d
  return int(n)


def flops_per_step(r: PublishedRun, convention: Optional[str] = None) -> float:
  """Model FLOPs of one optimizer step (all chips together) by a publisher's convention (module docstring). With
  experts every convention counts the routed experts only (MaxText's calculate_training_tflops and Megatron's
  num_floating_point_operations both do: ``num_experts_per_tok`` / ``moe_router_topk`` times the expert width)."""
  conv = convention or r.convention
  B, S, L, d, H, hd = r.global_batch, r.seq_len, r.n_layers, r.d_model, r.n_heads, r.head_dim
  n_act = n_params(r, active=True)
  if conv == "maxtext_6n_causal":
    return 6.0 * n_act * B * S + 6.0 * L * H * hd * S * S * B
  if conv == "megatron":
    gated = 1.5 if r.mlp == "swiglu" else 1.0
    per = (1 + r.n_kv_heads / H + S / d) * (H * hd / d) + gated * ffn_width(r) / d + r.vocab_size / (2.0 * L * d)
    return 12.0 * B * S * L * d * d * per
  if conv == "narayanan_hfu":
    return 96.0 * B * S * L * d * d * (1 + S / (6.0 * d) + r.vocab_size / (16.0 * L * d))
  if conv == "llmfoundry":
    return B * (6.0 * n_act * S + 12.0 * L * d * S * S)
  if conv in ("torchtitan", "palm"):
    return B * S * (6.0 * n_act + 12.0 * L * H * hd * S)
  if conv == "paxml_6n_full":
    return 6.0 * n_act * B * S + 12.0 * L * H * hd * S * S * B
  raise ValueError(f"row {r.id}: no FLOP convention ({conv!r}); known: {', '.join(CONVENTIONS)}")


# ------------------------------------------------------------------------------------------------ parsing

def _int(s: str, default: int = 0) -> int:
  s = (s or "").strip()
  m = re.match(r"^\d+", s)
  return int(m.group()) if m else default


def source_key(source: str) -> str:
  s = re.sub(r"\([^)]*\)", "", source)
  s = re.split(r" \+ | -> |; ", s)[0]
  return re.sub(r"\s+,", ",", re.sub(r"\s+", " ", s)).strip(" ,")


CHIPS = (  # (pattern in the chip column, profile, caveat)
    (r"^TPU v4", "tpu_v4", ""), (r"^TPU v5e", "tpu_v5e", ""), (r"^TPU v5p", "tpu_v5p", ""),
    (r"^TPU v6e", "tpu_v6e", ""),
    (r"^H100.*96GB", "h100", "H100 SXM 96 GB HBM2e at a 500 W cap (Grand Teton): not the 80 GB / 3.35 TB/s / "
                             "700 W part the h100 profile describes"),
    (r"^H100.*GCP A3", "h100", "GCP A3 VMs: GPUDirect-TCPX between VMs, far below the h100 profile's 400 Gb/s per GPU"),
    (r"^H100", "h100", ""), (r"^H200", "h200", ""),
    (r"^NVIDIA Ampere \(A100", "a100", "the source says 'NVIDIA Ampere GPUs'; A100 from the peak its MFU and aggregate "
                                      "FLOP/s imply; HBM size not stated (the a100 profile is the 80 GB part)"),
    (r"^A100.*40GB", "a100", "A100 40 GB (1.555 TB/s HBM2) with 1600 Gb/s RoCE per node, not the 80 GB part"),
    (r"^A100.*RoCE", "a100", "1600 Gb/s RoCE per node between nodes"),
    (r"^A100", "a100", ""),
)


def chip_profile(chip: str) -> tuple:
  for pat, prof, caveat in CHIPS:
    if re.search(pat, chip.strip()):
      return prof, caveat
  return None, ""


def precision_of(raw: str) -> str:
  p = raw.lower()
  for key in ("fp8", "int8"):
    if key in p:
      return key
  if "fp16" in p or "16-bit" in p:
    return "fp16"
  if "bf16" in p:
    return "bf16"
  return p.strip() or "unknown"


def remat_of(raw: str) -> tuple:
  """(MaxText-style policy name or None, exact) for the row's recompute column."""
  r = raw.strip().lower()
  if not r:
    return None, False
  if r.startswith("none"):
    return "none", True
  if r.startswith("full"):
    return "full", True
  if r.startswith("minimal (remat_policy=minimal)"):
    return "minimal", True
  if r.startswith("minimal_flash"):
    return "minimal_flash", False  # MaxText keeps the weight matmuls and the attention output ('context')
  if r.startswith("minimal") or r.startswith("save_dot_only") or r.startswith("save_dot_except_logits"):
    return "minimal", False  # also saves all dots / all but the logits
  if r.startswith("save_qkv_out_proj"):
    return "save_qkv_proj", False  # Praxis also saves the output projection
  if r.startswith("save_dot_except_mlpwi"):
    return "save_dot_except_mlp", False  # MaxText's *_mlpwi saves the MLP output projection too
  if r.startswith("custom: offload"):
    # MaxText's custom policy: the named tensors go to host memory, everything else is recomputed. On the chip that
    # is full recomputation (the layer input too is off the chip); with q/k/v offloaded they are not recomputed
    if any(n in r for n in ("query_proj", "key_proj", "value_proj", "q/k/v")):
      return "qkv_proj_offloaded", False
    return "full", False
  if r.startswith("selective (layer)") or r.startswith("custom"):
    return None, False  # every k-th layer recomputed / host offload: no MaxText-style name
  if r.startswith("selective"):
    return "minimal", False  # weight matmuls kept, attention core recomputed
  return None, False


def convention_of(row: dict) -> Optional[str]:
  d, fw = row["metric_definition"], row["framework"]
  if "MaxText" in d or "tiering" in d or fw.startswith("MaxText"):
    return "maxtext_6n_causal"
  if "96*B*s*l*h^2" in d:
    return "narayanan_hfu"
  if "attn_flops_per_seq" in d or fw.startswith("llm-foundry"):
    return "llmfoundry"
  if fw.startswith("torchtitan"):
    return "torchtitan"
  if fw.startswith("Paxml"):
    return "paxml_6n_full"
  if "Chowdhery" in d:
    return "palm"
  if "Megatron" in d or "NeMo" in d or "NeMo" in fw or "Megatron" in fw:
    return "megatron"
  return None


def _arch(row: dict) -> dict:
  text = " ".join((row["model"], row["notes"], row["framework"], row["source"])).lower()
  maxtext_2023 = "2023 base.yml" in text or "76bd53b0f" in row["source"]
  gpt = bool(re.search(r"\bgpt|mpt", text)) and "llama" not in row["model"].lower()
  if maxtext_2023:
    mlp = "relu"
  elif "llama" in row["model"].lower() or "swiglu" in text:
    mlp = "swiglu"
  elif gpt or "gelu" in text:
    mlp = "gelu"
  else:
    mlp = ""
  d, h = _int(row["d_model"]), _int(row["n_heads"])
  head_dim = 256 if maxtext_2023 else (d // h if h else 0)
  return {"mlp": mlp, "head_dim": head_dim, "parallel_block": maxtext_2023,
          "tie_embeddings": maxtext_2023 or gpt,  # MaxText 2023 base.yml logits_via_embedding=True; GPT/MPT tie
          "learned_positions": "learned pos" in text or ("paxml" in text and gpt),
          "biases": "biases" in text and "no biases" not in text}


def _row(row: dict, splits: dict) -> PublishedRun:
  arch = _arch(row)
  n_chips = _int(row["n_chips"])
  tp, pp, cp = (_int(row[k], 1) for k in ("tp", "pp", "cp"))
  fsdp = _int(row["fsdp"])
  dp = _int(row["dp"])
  if dp == 0 and n_chips and tp and pp and cp:
    dp = max(1, n_chips // (max(fsdp, 1) * tp * pp * cp)) if fsdp or row["tp"] else 0
  fsdp = fsdp or 1
  vpp_raw = row["vpp"].strip()
  vpp = _int(vpp_raw, 0 if vpp_raw else 1)
  gbs, mb = _int(row["global_batch_seqs"]), _int(row["micro_batch"])
  # MaxText's per_device_batch_size counts every chip (tensor-parallel ones too); elsewhere the micro-batch is per
  # data-parallel (data x fsdp) rank
  shards = n_chips if row["framework"].startswith("MaxText") else dp * fsdp
  micro = gbs // (mb * shards) if gbs and mb and shards and gbs % (mb * shards) == 0 else 0
  remat, exact = remat_of(row["recompute"])
  prec = precision_of(row["precision"])
  prof, hw_caveat = chip_profile(row["chip"])
  caveats = []
  if hw_caveat:
    caveats.append(hw_caveat)
  if arch["parallel_block"]:
    caveats.append("parallel attention+MLP block, head_dim 256, single ReLU MLP, tied embedding (MaxText 2023)")
  if remat is not None and not exact:
    caveats.append(f"recompute '{row['recompute']}' mapped to the nearest policy '{remat}'")
  if not row["recompute"].strip():
    caveats.append("recompute policy not published")
  if not mb:
    caveats.append("micro-batch size not published")
  if vpp == 0:
    caveats.append("interleaved pipeline, chunks per rank not published")
  kw = dict(
      id=row["id"], source=row["source"], source_key=source_key(row["source"]), framework=row["framework"],
      model=row["model"], n_layers=_int(row["n_layers"]), d_model=_int(row["d_model"]), n_heads=_int(row["n_heads"]),
      n_kv_heads=_int(row["n_kv_heads"]) or _int(row["n_heads"]), head_dim=arch["head_dim"], d_ff=_int(row["d_ff"]),
      vocab_size=_int(row["vocab"]), mlp=arch["mlp"], tie_embeddings=arch["tie_embeddings"],
      parallel_block=arch["parallel_block"], learned_positions=arch["learned_positions"], biases=arch["biases"],
      seq_len=_int(row["seq_len"]), global_batch=gbs, remat=remat, remat_exact=exact,
      recompute_raw=row["recompute"], dtype={"fp8": "float8", "int8": "int8"}.get(prec, "bfloat16"), precision=prec,
      data=dp, fsdp=fsdp, tensor=tp, pipeline=pp, sequence=cp, micro_batch=mb, microbatches=micro,
      virtual_stages=vpp, chip=row["chip"], hardware=prof, hardware_caveat=hw_caveat, n_chips=n_chips,
      metric=row["metric"], value=float(row["value"]), convention=convention_of(row), notes=row["notes"])
  kw.update(_moe_fields(row, kw, caveats))
  kw["table"] = f"{kw['source_key']} | {row['chip'].strip()} | {prec}"
  run = PublishedRun(measured_step_s=None, included=False, exclude_reason="", caveats=tuple(caveats), **kw)
  step, why = _step_seconds(run)
  reason = _exclusion(run, step, why)
  split, split_why = splits.get(row["id"], ("heldout", "added after the split was fixed"))
  return dataclasses.replace(run, measured_step_s=step, included=not reason, exclude_reason=reason, split=split,
                             split_why=split_why)


def _moe_fields(row: dict, kw: dict, caveats: list) -> dict:
  """The expert columns of published_moe_training.csv (absent or empty: a dense row). A Megatron-style dp that
  counts the expert-parallel ranks (EP inside DP: dp x tp x pp x cp = chips) becomes data = dp / ep, since the
  expert mesh axis shards the batch as data does (parallelism/README.md, Expert parallelism)."""
  e = _int(row.get("n_experts", ""))
  if not e:
    return {}
  ep = _int(row.get("ep", ""), 1) or 1
  data, fsdp, expert = kw["data"], kw["fsdp"], ep
  other = kw["tensor"] * kw["pipeline"] * kw["sequence"]
  if ep > 1 and fsdp == 1 and data * other == kw["n_chips"]:  # EP carved out of the data-parallel ranks
    if data % ep == 0:
      data //= ep
    elif ep % data == 0 and kw["tensor"] % (ep // data) == 0:  # Megatron's MoE parallel folding over TP ranks
      caveats.append(f"expert parallelism {ep} folds over tensor ranks: experts split over expert {data} x tensor "
                     f"{ep // data} (their width), not {ep} whole-expert ranks")
      expert, data = data, 1
  elif ep > 1 and fsdp * other * max(data, 1) == kw["n_chips"] and fsdp % ep == 0:  # EP inside the FSDP ranks
    fsdp //= ep
    caveats.append(f"expert parallelism inside FSDP: the dense parameters shard over fsdp {fsdp}, not "
                   f"{fsdp * ep} (replicated over the expert axis)")
  routing = (row.get("routing") or "").strip().lower()
  cf = float(row["capacity_factor"]) if routing.startswith("capacity") and (row.get("capacity_factor") or
                                                                             "").strip() else 0.0
  if _int(row.get("first_dense_layers", "")):
    caveats.append(f"first {_int(row['first_dense_layers'])} layers dense: the program runs every layer as MoE")
  if "mla" in (row["notes"] + row["model"]).lower() or "deepseek" in row["model"].lower():
    caveats.append("multi-head latent attention run as multi-head attention of the same heads")
  head_dim = _int(row.get("head_dim", "")) or kw["head_dim"]
  return {"n_experts": e, "experts_per_token": _int(row.get("experts_per_token", "")),
          "moe_d_ff": _int(row.get("moe_d_ff", "")), "n_shared_experts": _int(row.get("n_shared_experts", "")),
          "first_dense_layers": _int(row.get("first_dense_layers", "")), "expert": expert, "data": data,
          "fsdp": fsdp,
          "capacity_factor": cf, "head_dim": head_dim, "d_ff": kw["d_ff"] or _int(row.get("moe_d_ff", "")),
          "mlp": "swiglu", "tie_embeddings": False,  # every MoE family here gates its experts, unties its embedding
          "router": "sigmoid" if "sigmoid" in (row["notes"] + routing).lower() else "softmax"}


def bf16_peak(profile: str) -> float:
  return hardware.load(profile).peak("bf16")


def _step_seconds(r: PublishedRun) -> tuple:
  """(measured seconds per optimizer step or None, why not)."""
  m = r.metric.lower()
  if m.startswith("seconds per"):
    return r.value, ""
  if "tokens/s" in m:
    if not (r.global_batch and r.seq_len and r.n_chips):
      return None, "missing fields: global batch or chips for a tokens/s row"
    return r.tokens_per_step / (r.value * r.n_chips), ""
  if "tflop/s" in m or m == "mfu":
    if r.convention is None or not r.global_batch:
      return None, "missing fields: FLOP convention or global batch for a FLOP-rate row"
    rate = r.value * 1e12 if "tflop/s" in m else r.value * bf16_peak(r.hardware)
    return flops_per_step(r) / (rate * r.n_chips), ""
  return None, f"metric '{r.metric}' is not a step time (e.g. includes evaluation)"


def _exclusion(r: PublishedRun, step: Optional[float], why: str) -> str:
  if r.precision == "int8":
    return "int8 precision: no int8 training path"
  if r.hardware is None:
    return f"unknown chip '{r.chip}'"
  if not r.n_experts and ("moe" in (r.model + r.notes).lower() or "experts" in r.notes.lower()):
    return "mixture of experts without its expert columns (published_moe_training.csv has them)"
  if "sliding window attention" in r.notes.lower():
    return "unsupported architecture: sliding-window attention (window size not published)"
  if not r.mlp:
    return "unsupported architecture: MLP kind not identified"
  if "CONFLICT" in r.notes:
    return "conflicting published configuration: " + r.notes.split(". ")[0]
  if r.n_experts and not (r.experts_per_token and r.moe_d_ff):
    return "missing fields: experts per token or expert width"
  if r.n_experts and ("interleave_moe_layer_step" in r.notes or "alternate" in r.notes.lower()):
    return "unsupported architecture: dense and MoE layers alternate"
  if r.n_experts and "sliding window" in r.notes.lower():
    return "unsupported architecture: sliding-window attention on some layers (not built)"
  if step is None:
    return why
  missing = [k for k in ("n_layers", "d_model", "n_heads", "d_ff", "vocab_size", "seq_len", "global_batch", "n_chips")
             if not getattr(r, k)]
  if missing:
    return "missing fields: " + ", ".join(missing)
  if not r.data:
    return "missing fields: parallel layout (data / tensor / pipeline degrees) not published"
  if r.data * r.fsdp * r.tensor * r.pipeline * r.sequence * r.expert != r.n_chips:
    return (f"layout data {r.data} x fsdp {r.fsdp} x tensor {r.tensor} x pipeline {r.pipeline} x sequence "
            f"{r.sequence} x expert {r.expert} does not multiply to {r.n_chips} chips")
  if not (math.isfinite(step) and step > 0):
    return "step time not finite and positive"
  return ""


def load(path: Optional[str] = None) -> list:
  """All rows of the published CSV (included and excluded), in file order, each with its split."""
  path = path or default_path()
  if not os.path.exists(path):
    raise FileNotFoundError(f"published training rows not found at {path}; pass the path of a "
                            f"published_training.csv (the committed one: {os.path.relpath(DEFAULT_CSV, ROOT)})")
  splits = load_split(split_path(path))
  with open(path, newline="") as f:
    return [_row(row, splits) for row in csv.DictReader(f)]


def included(rows: list, precision: Optional[tuple] = ("bf16", "fp16", "fp8")) -> list:
  return [r for r in rows if r.included and (precision is None or r.precision in precision)]


# ------------------------------------------------------------------------------------------------ held-out split

def heldout_rule(row_id: str, precision: str) -> str:
  """Why a row is held out ('' = design row). Fixed before any row was re-scored: every fp8 row (no fp8 program
  existed, so no error of theirs was ever seen) and the rows whose id hashes to 0 mod 4 (sha256, about a quarter).
  Rows added to the CSV after ``published_split.csv`` was written are held out too (:func:`load`)."""
  if precision == "fp8":
    return "fp8 row"
  if int(hashlib.sha256(row_id.encode()).hexdigest()[:8], 16) % 4 == 0:
    return "sha256(id) mod 4 == 0"
  return ""


def split_path(csv_path: str) -> str:
  """The committed split beside a rows file: published_training.csv -> published_split.csv,
  published_moe_training.csv -> published_moe_split.csv."""
  d, name = os.path.split(csv_path)
  return os.path.join(d, name.replace("_training.csv", "_split.csv")) if name.endswith("_training.csv") else SPLIT_CSV


def load_split(path: str = SPLIT_CSV) -> dict:
  """{row id: (split, why)} from the committed split (empty when the file is absent: every row held out)."""
  if not os.path.exists(path):
    return {}
  with open(path, newline="") as f:
    return {row["id"]: (row["split"], row["why"]) for row in csv.DictReader(f)}
