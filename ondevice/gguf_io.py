"""GGUF export (framework params -> llama.cpp-compatible file) and import/inspection.

Export writes the llama architecture (qwen2 for a model with q/k/v biases) with llama.cpp tensor names and
q/k rows in llama.cpp's RoPE order (both via ``framework.names``), Llama 3's rope_freqs.weight for
``model.rope_scaling='llama3'``, page-aligned tensor data (4096 B) so every layer is an
mmap-able, madvise-able byte range, PrismLLM's byte tokenizer as an SPM vocab (ondevice/tokenizer.py),
and the exact framework ModelConfig as JSON under ``prismllm.model_config`` for a lossless round trip.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import zlib
from typing import Any, Optional

import numpy as np

from framework import names, rope
from framework.config import ModelConfig
from ondevice import gguf_check
from ondevice.gguf_check import CRC_KEY, GGUFError  # noqa: F401  (GGUFError: re-exported)
from ondevice.tokenizer import ByteTokenizer

QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "q4_k")
LLAMA_QUANTS = {"q4_k": "Q4_K_M", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}  # via llama.cpp
PAGE = 4096
_BLOCKED = ("q8_0", "q4_0")




@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  qtype: str  # 'F32' | 'F16' | 'Q8_0' | 'Q4_0' | ...
  shape: tuple  # numpy order: (n_out, n_in) for matrices, (n,) for vectors
  offset: int  # absolute byte offset in the file
  nbytes: int


@dataclasses.dataclass(frozen=True)
class GGUFInfo:
  """Everything the runtime needs from a GGUF file's header (no tensor data is read)."""
  path: str
  cfg: ModelConfig
  tensors: dict  # name -> TensorInfo
  alignment: int
  file_size: int
  tokens: tuple
  token_types: tuple
  eos_id: int
  byte_tokenizer: bool
  unsupported: tuple = ()  # features this runtime does not implement (gguf_check.check_runnable)
  crc: dict = dataclasses.field(default_factory=dict)  # tensor name -> CRC32 of its bytes (our exports)
  bos_id: Optional[int] = None  # prepended to text prompts when the file says add_bos_token (llama.cpp does)
  arch: str = "llama"  # general.architecture: llama (and mistral, Mixtral), qwen2, qwen3, qwen3moe
  moe: Optional[gguf_check.MoE] = None  # experts per layer, routed per token, expert width (None: dense)

  @property
  def rope_neox(self) -> bool:
    """llama.cpp's RoPE mode for the architecture: NEOX (pairs i, i + E/2) for qwen2/qwen3, NORM for llama."""
    return self.arch in ("qwen2", "qwen3", "qwen3moe")

  def layer_range(self, i: int) -> tuple:
    """[start, end) bytes of layer i's tensors (contiguous as written by export)."""
    ts = [t for n, t in self.tensors.items() if n.startswith(f"blk.{i}.")]
    return min(t.offset for t in ts), max(t.offset + t.nbytes for t in ts)

  def layer_bytes(self, i: int) -> int:
    return sum(t.nbytes for n, t in self.tensors.items() if n.startswith(f"blk.{i}."))

  def tensor_qtype(self, name: str) -> str:
    return self.tensors[name].qtype


# ------------------------------------------------------------------------------------------ export

def _matrix_qtype(quant: str, n_in: int) -> str:
  if quant in _BLOCKED and n_in % 32:
    return "F16"  # ggml block quants need rows that are a multiple of 32
  return {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}[quant]


def export_gguf(params: Any, cfg: ModelConfig, path: str, quant: str = "f32", align: int = PAGE,
                name: str = "prismllm", output_quant: Optional[str] = None) -> dict:
  """Writes ``params`` (framework tree) as a GGUF of architecture :func:`gguf_arch` (llama, or qwen2 for a model
  with q/k/v biases), with Llama 3's ``rope_freqs.weight`` for ``model.rope_scaling='llama3'``; returns a small
  summary dict.

  ``quant`` applies to every matrix (token_embd included, as llama.cpp does); norms stay F32.
  ``q4_k_m`` / ``q5_k_m`` / ``q6_k`` (``q4_k`` = q4_k_m) quantise an F16 file with llama.cpp's own quantiser
  (needs llama-cpp-python).
  """
  arch = gguf_arch(cfg)
  arrays = names.framework_to_gguf(params, cfg, arch)
  factors = rope.freq_factors(cfg)
  if factors is not None:
    arrays = {"rope_freqs.weight": factors, **arrays}
  return write_quantized(arrays, cfg, path, quant, align, name, output_quant, arch=arch)


def gguf_arch(cfg: ModelConfig) -> str:
  """The llama.cpp architecture a framework model is written as: ``qwen2`` for q/k/v biases with plain RoPE (its
  NEOX rotary is HF's rotate-half: q/k rows unpermuted), ``llama`` otherwise (its graph adds q/k/v biases when
  present and reads Llama 3's rope_freqs.weight, which the qwen2 graph ignores)."""
  return "qwen2" if cfg.qkv_bias and cfg.rope_scaling == "none" else "llama"


def write_quantized(arrays: dict, cfg: ModelConfig, path: str, quant: str = "f32", align: int = PAGE,
                    name: str = "prismllm", output_quant: Optional[str] = None, arch: str = "llama",
                    vocab=None, moe: Optional[gguf_check.MoE] = None) -> dict:
  """``write_arrays`` for every ``QUANTS`` entry: the K-quant mixes go through llama.cpp's quantiser."""
  quant = quant.lower()
  if quant not in QUANTS:
    raise GGUFError(f"--quant {quant!r} unknown; choose one of {', '.join(QUANTS)}")
  if quant not in LLAMA_QUANTS:
    return write_arrays(arrays, cfg, path, quant, align, name, output_quant, arch=arch, vocab=vocab, moe=moe)
  bad = [n for n, a in arrays.items() if np.ndim(a) >= 2 and np.shape(a)[-1] % 256]
  if bad:
    raise GGUFError(f"{quant} needs matrices with a multiple of 256 inputs ({bad[0]} has "
                    f"{np.shape(arrays[bad[0]])[-1]}); use --quant q4_0 or q8_0")
  tmp = path + ".f16.tmp"
  # Default (32-byte) alignment: llama.cpp 0.3.36's quantiser copies general.alignment = 4096 from its input but
  # pads tensors to 32, so a page-aligned input gives a file llama.cpp itself rejects. K-quant files are therefore
  # not page-aligned. No CRCs: the quantiser copies the metadata, and the CRCs would be the F16 tensors'.
  write_arrays(arrays, cfg, tmp, "f16", 32, name, arch=arch, vocab=vocab, crc=False, moe=moe)
  try:
    llama_quantize(tmp, path, LLAMA_QUANTS[quant])
  finally:
    os.remove(tmp)
  return {"path": path, "quant": quant, "bytes": os.path.getsize(path)}


def llama_quantize(src: str, dst: str, kind: str) -> None:
  """llama.cpp's quantiser (llama_model_quantize) on a GGUF file: ``kind`` Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0."""
  try:
    import ctypes
    import llama_cpp
  except ImportError as e:
    raise GGUFError(f"{kind} files are made by llama.cpp's quantiser: pip install llama-cpp-python (.ci/"
                    f"llama_cpp_wheel.sh), or export q4_0/q8_0") from e
  p = llama_cpp.llama_model_quantize_default_params()
  p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
  tmp = dst + ".partial"
  try:
    rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(p))
    if rc != 0:
      raise GGUFError(f"llama_model_quantize failed with code {rc}")
    os.replace(tmp, dst)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_arrays(arrays: dict, cfg: ModelConfig, path: str, quant: str = "f32", align: int = PAGE,
                 name: str = "prismllm", output_quant: Optional[str] = None, crc: bool = True, arch: str = "llama",
                 vocab=None, moe: Optional[gguf_check.MoE] = None) -> dict:
  """GGUF tensor name -> f32 array (llama.cpp layout: q/k rows RoPE-permuted for llama, not for qwen2/qwen3)
  -> a GGUF file of architecture ``arch``. ``vocab``: a ``vocab.Vocab`` (default: the byte vocabulary).
  ``crc=False``: no per-tensor CRC32s (a file llama.cpp's quantiser rewrites: it copies the metadata).
  ``moe``: a mixture-of-experts file (``{arch}.expert_count`` / ``expert_used_count``, and for qwen3moe
  ``expert_feed_forward_length``); the router ``ffn_gate_inp`` stays F32 (llama.cpp's quantiser keeps it so) and
  each stacked expert tensor gets one CRC32 per expert (``name#e``), checked when that expert is first read."""
  import gguf
  if arch not in gguf_check.ARCHS:
    raise GGUFError(f"architecture {arch!r} unknown; choose one of {', '.join(gguf_check.ARCHS)}")
  w = gguf.GGUFWriter(path, arch)
  w.data_alignment = align
  w.add_custom_alignment(align)
  w.add_name(name)
  w.add_context_length(cfg.max_seq_len)
  w.add_embedding_length(cfg.d_model)
  w.add_block_count(cfg.n_layers)
  w.add_feed_forward_length(cfg.ff)
  if moe is not None:
    w.add_expert_count(moe.n_expert)
    w.add_expert_used_count(moe.n_used)
    if arch == "qwen3moe":
      w.add_expert_feed_forward_length(moe.ff)
  w.add_head_count(cfg.n_heads)
  w.add_head_count_kv(cfg.n_kv_heads)
  w.add_key_length(cfg.hd)
  w.add_value_length(cfg.hd)
  w.add_rope_dimension_count(cfg.hd)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
           "bf16": gguf.LlamaFileType.MOSTLY_BF16,
           "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[quant]
  w.add_file_type(ftype)
  from ondevice import vocab as vocab_lib
  (vocab or vocab_lib.byte_vocab(cfg.vocab_size)).write(w)
  w.add_string("prismllm.model_config", json.dumps(dataclasses.asdict(cfg)))
  counts: dict = {}
  counts_of: dict = {}
  data = {}
  for tname, arr in arrays.items():
    arr = np.asarray(arr, np.float32)
    if arr.ndim == 1 or tname.endswith("ffn_gate_inp.weight"):
      qt = "F32"
    else:
      q = output_quant if (output_quant and tname == "output.weight") else quant
      qt = _matrix_qtype(q, arr.shape[-1])
    counts[qt] = counts.get(qt, 0) + 1
    counts_of[tname] = qt
    gq = getattr(gguf.GGMLQuantizationType, qt)
    if qt == "F32":
      data[tname] = (arr, None)
    elif qt == "F16":
      data[tname] = (arr.astype(np.float16), None)
    else:
      data[tname] = (gguf.quants.quantize(arr, gq), gq)
  # CRC32 (and type) of every tensor's bytes: weights.MappedGGUF checks a tensor's when it is first used, so a file
  # damaged after export fails with a clear error instead of computing on flipped bits. A tool that re-quantises
  # the file (llama.cpp's quantiser) copies this metadata: tensors whose type changed are not checked.
  if crc:
    crcs = {}
    for n, (a, _) in data.items():
      a = np.ascontiguousarray(a)
      crcs[n] = [zlib.crc32(a.tobytes()), counts_of[n]]
      if layer_of(n) is not None and n.split(".")[2] in gguf_check.EXPERT_MATS:
        crcs.update({f"{n}#{e}": [zlib.crc32(a[e].tobytes()), counts_of[n]] for e in range(a.shape[0])})
    w.add_string(CRC_KEY, json.dumps(crcs))
  for tname, (a, gq) in data.items():
    w.add_tensor(tname, a, raw_dtype=gq)
  tmp = path + ".partial"  # written next to the target, renamed only when complete: a failed export loses nothing
  try:
    w.write_header_to_file(pathlib.Path(tmp))
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return {"path": path, "quant": quant, "bytes": os.path.getsize(path), "tensor_types": counts}


def tiny_config(**kw) -> ModelConfig:
  """A small llama shape (byte vocabulary) for test models, the smoke decode and the fault cases."""
  base = dict(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=256,
              init_std=0.2)
  return ModelConfig(**{**base, **kw})


def random_arrays(cfg: ModelConfig, seed: int = 0, std: float = 0.2, arch: str = "llama",
                  rope_freqs=None, moe: Optional[gguf_check.MoE] = None) -> dict:
  """GGUF tensor name -> f32 array of a random ``arch`` model (std 0.2: peaked logits, so greedy tokens are
  stable against rounding and comparisons between files are meaningful). Norm weights are 1 + 0.1 N(0, 1),
  biases std N(0, 1); ``rope_freqs``: Llama 3's factors (rope_freqs.weight), written first."""
  rng = np.random.default_rng(seed)
  out = {} if rope_freqs is None else {"rope_freqs.weight": np.asarray(rope_freqs, np.float32)}
  for name, shape in gguf_check.expected_shapes(cfg, arch, moe).items():
    if name.endswith(".bias"):
      a = std * rng.standard_normal(shape)
    else:
      a = 1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else std * rng.standard_normal(shape)
    out[name] = a.astype(np.float32)
  return out


# ------------------------------------------------------------------------------------------ import

def _field(reader, key, default=None):
  f = reader.fields.get(key)
  if f is None:
    return default
  v = f.parts[f.data[0]]
  if f.types and f.types[0].name == "STRING":
    return bytes(v).decode("utf-8")
  return v.tolist()[0] if hasattr(v, "tolist") and len(v) == 1 else v


def _cfg_from_keys(path, reader, arch: str) -> ModelConfig:
  g = lambda k, d=None: _field(reader, f"{arch}." + k, d)  # noqa: E731
  if g("embedding_length") is None or g("attention.head_count") is None or g("block_count") is None:
    raise GGUFError(f"{path} lacks {arch}.* hyperparameters (embedding_length, attention.head_count, block_count); "
                    f"export it with them (ondevice.export writes them)")
  d, h = int(g("embedding_length")), int(g("attention.head_count"))
  n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
  ff = g("feed_forward_length")
  return ModelConfig(vocab_size=int(g("vocab_size", n_vocab)), d_model=d, n_layers=int(g("block_count")),
                     n_heads=h, n_kv_heads=int(g("attention.head_count_kv", h)),
                     head_dim=int(g("attention.key_length", d // max(h, 1))), d_ff=int(ff) if ff else -1,
                     rope_theta=float(g("rope.freq_base", 10000.0)),
                     norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
                     tie_embeddings="output.weight" not in [t.name for t in reader.tensors],
                     max_seq_len=int(g("context_length", 2048)))


def _read_cfg(path, reader, arch: str) -> ModelConfig:
  cfg_json = _field(reader, "prismllm.model_config")
  if not cfg_json:
    return _cfg_from_keys(path, reader, arch)
  try:
    return ModelConfig(**json.loads(cfg_json))
  except (ValueError, TypeError) as e:
    raise GGUFError(f"{path}: metadata prismllm.model_config is damaged ({type(e).__name__}); re-export it with "
                    f"`python -m ondevice.export` or re-copy it") from None


def read_info(path: str) -> GGUFInfo:
  """Parses a GGUF header: bounds-checked walk first (gguf_check.scan_header), then the gguf reader, then
  the config, tensor shapes, alignment and overlaps (gguf_check.check_structure). Raises GGUFError."""
  from gguf import GGUFReader
  if not os.path.exists(path):
    raise GGUFError(f"{path}: no such file; create one with `python -m ondevice.export --random --out {path}`")
  if os.path.isdir(path):
    raise GGUFError(f"{path} is a directory; pass a .gguf file")
  size = os.path.getsize(path)
  gguf_check.scan_header(path)
  try:
    reader = GGUFReader(path, "r")
  except Exception as e:  # the reader raises ValueError/IndexError/... on bad bytes
    raise GGUFError(f"{path} is not a readable GGUF file ({type(e).__name__}: {str(e)[:120]}); it is corrupt or "
                    f"truncated ({size} bytes): re-export it with `python -m ondevice.export`") from None
  arch = _field(reader, "general.architecture")
  if arch not in gguf_check.ARCHS:
    raise GGUFError(f"{path}: architecture {arch!r} is not supported (this runtime runs "
                    f"{', '.join(gguf_check.ARCHS)}; mistral files are llama files); run it with llama.cpp")
  if "tokenizer.ggml.tokens" not in reader.fields:
    raise GGUFError(f"{path} has no tokenizer.ggml.tokens vocabulary; export it with its tokenizer")
  tensors = {}
  for t in reader.tensors:
    if t.name in tensors:
      raise GGUFError(f"{path}: tensor {t.name} appears twice: the tensor index is corrupt; re-export or re-copy it")
    shape = tuple(int(s) for s in reversed([int(x) for x in t.shape]))
    tensors[t.name] = TensorInfo(t.name, t.tensor_type.name, shape, int(t.data_offset), int(t.n_bytes))
  cfg = _read_cfg(path, reader, arch)
  tok_field = reader.fields["tokenizer.ggml.tokens"]
  try:
    tokens = tuple(bytes(tok_field.parts[i]).decode("utf-8") for i in tok_field.data)
  except UnicodeDecodeError:
    raise GGUFError(f"{path}: a vocabulary entry is not UTF-8: the metadata is corrupt; re-export or re-copy it") \
        from None
  gguf_check.check_config(path, cfg, len(tokens))
  fields = {k[len(arch) + 1:]: _field(reader, k) for k in reader.fields if k.startswith(arch + ".")}
  moe = gguf_check.moe_from_fields(path, fields, cfg, arch)
  gguf_check.check_structure(path, tensors, cfg, int(reader.alignment), size, arch, moe)
  tt_field = reader.fields.get("tokenizer.ggml.token_type")
  types = tuple(int(tt_field.parts[i][0]) for i in tt_field.data) if tt_field else (1,) * len(tokens)
  eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 2))
  # Our byte vocabulary, whoever wrote the file: an SPM vocab whose first 256 entries are ByteTokenizer's.
  byte_tok = (_field(reader, "prismllm.tokenizer") == "bytes" or
              (_field(reader, "tokenizer.ggml.model") == "llama" and len(tokens) >= 256
               and tokens[:256] == tuple(ByteTokenizer(256).gguf_vocab()[0])))
  bos = _field(reader, "tokenizer.ggml.bos_token_id")
  bos = int(bos) if bos is not None and _field(reader, "tokenizer.ggml.add_bos_token", False) else None
  unsupported = tuple(gguf_check.unsupported_features(path, fields, cfg, arch, list(tensors), moe=moe))
  crc = gguf_check.parse_crc(_field(reader, CRC_KEY))
  return GGUFInfo(path, cfg, tensors, int(reader.alignment), size, tokens, types, eos, byte_tok, unsupported, crc, bos,
                  arch, moe)


def export_moe_gguf(params, cfg, path: str, quant: str = "f32", name: str = "prismllm", output_quant=None,
                    vocab=None) -> dict:
  """A framework mixture-of-experts model (``cfg.n_experts > 0``) -> a GGUF in llama.cpp's Mixtral layout: arch
  ``llama`` with ``llama.expert_count`` / ``expert_used_count``, ``feed_forward_length`` = the experts' width;
  q/k rows RoPE-permuted and the experts stacked as names.py says; Llama 3's ``rope_freqs.weight`` for
  ``rope_scaling='llama3'``. The router stays F32 (write_arrays). ``vocab``: a checkpoint's tokenizer
  (ondevice.hf_gguf.hf_vocab); None: the byte vocabulary."""
  from ondevice.errors import InputError  # noqa: PLC0415 (the CLI's one-line error)
  why = names.mixtral_unsupported(cfg)
  if why:
    raise InputError(why)
  arrays = names.framework_to_gguf(params, cfg, "llama")
  factors = rope.freq_factors(cfg)
  if factors is not None:
    arrays = {"rope_freqs.weight": factors, **arrays}
  # the file's model_config: the same model, its dense width the experts' (llama.feed_forward_length)
  file_cfg = dataclasses.replace(cfg, d_ff=cfg.expert_ff, moe_d_ff=cfg.expert_ff)
  moe = gguf_check.MoE(cfg.n_experts, cfg.experts_per_token, cfg.expert_ff)
  return write_quantized(arrays, file_cfg, path, quant, name=name, output_quant=output_quant, arch="llama", moe=moe,
                         vocab=vocab)


def load_params(path: str, scan_layers: bool = True) -> tuple:
  """GGUF -> (framework params tree of f32 numpy arrays, ModelConfig). Quantised tensors are dequantised. A
  mixture-of-experts file in llama.cpp's Mixtral layout (arch llama with experts) loads as the framework's Mixtral
  model (softmax router, top-k renormalised: framework/names.py ``mixtral_unsupported``); qwen3moe files do not."""
  from gguf import GGUFReader
  from gguf.quants import dequantize
  info = read_info(path)
  cfg = info.cfg
  if info.moe is not None:
    if info.arch != "llama":
      raise GGUFError(f"{path} is a {info.arch} mixture-of-experts file: the framework loads llama.cpp's Mixtral "
                      f"layout (arch llama) only; run it with `python -m ondevice.run --model {path}`")
    if not cfg.moe:  # a file without prismllm.model_config (llama.cpp's converter): Mixtral's routing
      cfg = dataclasses.replace(cfg, n_experts=info.moe.n_expert, experts_per_token=info.moe.n_used,
                                moe_d_ff=info.moe.ff, router="softmax", moe_norm_topk=True)
  reader = GGUFReader(path, "r")
  arrays = {}
  for t in reader.tensors:
    a = dequantize(t.data, t.tensor_type)
    arrays[t.name] = np.asarray(a, np.float32).reshape(info.tensors[t.name].shape)
  cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
  return names.gguf_to_framework(arrays, cfg, info.arch), cfg


def describe(info: GGUFInfo) -> str:
  c = info.cfg
  kinds = sorted({t.qtype for t in info.tensors.values()})
  moe = f" experts={info.moe.n_used}/{info.moe.n_expert}x{info.moe.ff}" if info.moe else ""
  return (f"{os.path.basename(info.path)}: {info.arch} L={c.n_layers} D={c.d_model} H={c.n_heads}/{c.n_kv_heads} "
          f"F={c.ff}{moe} V={c.vocab_size} types={kinds} {info.file_size / 2**20:.1f} MiB")


_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def layer_of(tensor_name: str) -> Optional[int]:
  m = _LAYER_RE.match(tensor_name)
  return int(m.group(1)) if m else None
