"""Checks that turn a bad GGUF file into one line naming the fix, before any tensor is used.

``scan_header`` walks the header (magic, version, metadata, tensor index) with bounds checks BEFORE the
``gguf`` package's reader sees the file: a flipped count or length in a damaged file would otherwise
make that reader loop for minutes or allocate gigabytes. ``check_structure`` checks what the header
promises (shapes against the config, alignment, overlaps, config sanity); ``check_runnable`` what this
runtime can compute on (tensor types, llama features it does not implement). Tensor data is covered by
per-tensor CRC32s that ``export`` writes (``prismllm.tensor_crc32``) and ``weights.MappedGGUF`` checks when
a tensor is first used; files from other writers carry none, so their data is only checked for
non-finite block scales and norms.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Optional

MAGIC = b"GGUF"
# GGUF value types: size in bytes for the fixed-size ones; 8 = string, 9 = array.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4
RUNTIME_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe")  # mistral files are llama files; Mixtral: llama with experts
CRC_KEY = "prismllm.tensor_crc32"
EXPERT_MATS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclasses.dataclass(frozen=True)
class MoE:
  """A mixture-of-experts file's routing: ``n_expert`` experts per layer, ``n_used`` routed per token, expert
  feed-forward width ``ff`` (llama: feed_forward_length; qwen3moe: expert_feed_forward_length)."""
  n_expert: int
  n_used: int
  ff: int


def moe_from_fields(path: str, fields: dict, cfg, arch: str) -> Optional[MoE]:
  """The MoE spec of a file's ``{arch}.*`` metadata (prefix removed), None for a dense file; bad counts raise."""
  n = int(fields.get("expert_count") or 0)
  if n == 0:
    if arch == "qwen3moe":
      raise GGUFError(f"{path}: a qwen3moe file without qwen3moe.expert_count; {_fix(path)}")
    return None
  used = int(fields.get("expert_used_count") or 0)
  ff = int(fields.get("expert_feed_forward_length") or 0) if arch == "qwen3moe" else cfg.ff
  if not 1 <= used <= n or ff <= 0:
    raise GGUFError(f"{path}: {arch}.expert_used_count={used} / expert_count={n} / expert feed-forward width {ff} "
                    f"are inconsistent (need 1 <= used <= count, width > 0); {_fix(path)}")
  return MoE(n, used, ff)


class GGUFError(ValueError):
  """A GGUF file that cannot be used; the message says how to get a good one."""


def _fix(path: str) -> str:
  return f"re-export it with `python -m ondevice.export ... --out {path}` or re-copy it"


class _Short(Exception):
  """The header runs past the bytes read so far: read more."""


def scan_header(path: str) -> dict:
  """Walks the header with bounds checks; returns {'n_tensors', 'n_kv', 'header_end'}. Raises GGUFError
  naming the part that is damaged (truncated, impossible count or length, unknown type). Reads 1 MB of the file
  first and up to 64 MB only if the header is longer (headers of real files are a few MB at most: vocabularies)."""
  size = os.path.getsize(path)
  for limit in (1 << 20, 64 << 20):
    with open(path, "rb") as f:
      buf = f.read(min(size, limit))
    try:
      return _scan(path, size, buf, len(buf) < min(size, 64 << 20))
    except _Short:
      continue
  raise AssertionError("unreachable")


def _scan(path: str, size: int, buf: bytes, partial: bool) -> dict:
  end = len(buf)
  pos = 0

  def need(n, what):
    if n >= 0 and pos + n > end and partial:
      raise _Short()
    if n < 0 or pos + n > end:
      raise GGUFError(f"{path} is truncated or corrupt in its {what} (needs {n} bytes at offset {pos}, the "
                      f"header region has {end}); {_fix(path)}")

  def u(fmt, what):
    nonlocal pos
    n = struct.calcsize(fmt)
    need(n, what)
    v = struct.unpack_from("<" + fmt, buf, pos)[0]
    pos += n
    return v

  def string(what, limit=1 << 20):
    nonlocal pos
    n = u("Q", what)
    if n > limit:
      raise GGUFError(f"{path}: {what} claims a {n}-byte string: the header is corrupt; {_fix(path)}")
    need(n, what)
    pos += n
    return bytes(buf[pos - n:pos])

  if size < 4 or buf[:4] != MAGIC:
    if size == 0:
      raise GGUFError(f"{path} is empty; {_fix(path)}")
    raise GGUFError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF'); {_fix(path)}")
  pos = 4
  version = u("I", "version")
  if version not in (2, 3):
    raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3; a big-endian file or a corrupt "
                    f"header); {_fix(path)}")
  n_tensors, n_kv = u("Q", "tensor count"), u("Q", "metadata count")
  # Every KV entry takes >= 12 bytes and every tensor entry >= 28: counts above that are corruption.
  if n_kv * 12 + n_tensors * 28 > size:
    raise GGUFError(f"{path}: header claims {n_kv} metadata entries and {n_tensors} tensors, more than a "
                    f"{size}-byte file can hold: the header is corrupt; {_fix(path)}")
  for i in range(n_kv):
    key = string(f"metadata key #{i}", 1 << 16)
    try:
      key.decode("utf-8")
    except UnicodeDecodeError:
      raise GGUFError(f"{path}: metadata key #{i} is not UTF-8: the header is corrupt; {_fix(path)}") from None
    what = f"metadata value {key.decode('utf-8', 'replace')!r}"
    t = u("I", what)
    if t in _FIXED:
      need(_FIXED[t], what)
      pos += _FIXED[t]
    elif t == _STRING:
      string(what)
    elif t == _ARRAY:
      et, n = u("I", what), u("Q", what)
      if et in _FIXED:
        need(n * _FIXED[et], what)
        pos += n * _FIXED[et]
      elif et == _STRING:
        if n * 8 > end - pos:
          if partial:
            raise _Short()
          raise GGUFError(f"{path}: {what} claims {n} strings, more than the header holds: corrupt; {_fix(path)}")
        for j in range(n):
          string(f"{what}[{j}]")
      else:
        raise GGUFError(f"{path}: {what} is an array of unknown type {et}: the header is corrupt; {_fix(path)}")
    else:
      raise GGUFError(f"{path}: {what} has unknown type {t}: the header is corrupt; {_fix(path)}")
  from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
  for i in range(n_tensors):
    name = string(f"tensor #{i} name", 1 << 12)
    what = f"tensor #{i} ({name.decode('utf-8', 'replace')!r})"
    nd = u("I", what)
    if not 1 <= nd <= MAX_DIMS:
      raise GGUFError(f"{path}: {what} has {nd} dimensions: the tensor index is corrupt; {_fix(path)}")
    dims = [u("Q", what) for _ in range(nd)]
    t = u("I", what)
    try:
      qt = GGMLQuantizationType(t)
    except ValueError:
      raise GGUFError(f"{path}: {what} has unknown tensor type {t}: the tensor index is corrupt, or the file "
                      f"is newer than the gguf package; {_fix(path)}") from None
    u("Q", what)  # offset, checked against the file in check_structure
    blk = GGML_QUANT_SIZES[qt][0]
    if any(d == 0 for d in dims) or dims[0] % blk or math.prod(dims) > size * 64:
      raise GGUFError(f"{path}: {what} has impossible shape {dims} for {qt.name}: the tensor index is corrupt; "
                      f"{_fix(path)}")
  return {"n_tensors": n_tensors, "n_kv": n_kv, "header_end": pos, "version": version}


def expected_shapes(cfg, arch: str = "llama", moe: Optional[MoE] = None) -> dict:
  """GGUF tensor name -> numpy-order shape of the tensors a model of ``cfg`` and ``arch`` must have. With ``moe``
  the feed-forward block is llama.cpp's MoE layout: the router ``ffn_gate_inp`` (n_expert, D) and the stacked
  experts ``ffn_{gate,up}_exps`` (n_expert, F, D) and ``ffn_down_exps`` (n_expert, D, F)."""
  D, H, K, E, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.hd, cfg.ff, cfg.vocab_size
  out = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
  if not cfg.tie_embeddings:
    out["output.weight"] = (V, D)
  for i in range(cfg.n_layers):
    out.update({f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.attn_q.weight": (H * E, D),
                f"blk.{i}.attn_k.weight": (K * E, D), f"blk.{i}.attn_v.weight": (K * E, D),
                f"blk.{i}.attn_output.weight": (D, H * E), f"blk.{i}.ffn_norm.weight": (D,)})
    if moe is None:
      out.update({f"blk.{i}.ffn_gate.weight": (F, D), f"blk.{i}.ffn_up.weight": (F, D),
                  f"blk.{i}.ffn_down.weight": (D, F)})
    else:
      X, Fe = moe.n_expert, moe.ff
      out.update({f"blk.{i}.ffn_gate_inp.weight": (X, D), f"blk.{i}.ffn_gate_exps.weight": (X, Fe, D),
                  f"blk.{i}.ffn_up_exps.weight": (X, Fe, D), f"blk.{i}.ffn_down_exps.weight": (X, D, Fe)})
    if arch == "qwen2":
      out.update({f"blk.{i}.attn_q.bias": (H * E,), f"blk.{i}.attn_k.bias": (K * E,), f"blk.{i}.attn_v.bias": (K * E,)})
    if arch in ("qwen3", "qwen3moe"):
      out.update({f"blk.{i}.attn_q_norm.weight": (E,), f"blk.{i}.attn_k_norm.weight": (E,)})
  return out


def optional_shapes(cfg, arch: str = "llama") -> dict:
  """Tensors llama.cpp's graph for ``arch`` uses when present: Llama 3's rope_freqs, q/k/v biases (llama)."""
  H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.hd
  out = {"rope_freqs.weight": (E // 2,)} if arch == "llama" else {}
  if arch == "llama":
    for i in range(cfg.n_layers):
      out.update({f"blk.{i}.attn_q.bias": (H * E,), f"blk.{i}.attn_k.bias": (K * E,), f"blk.{i}.attn_v.bias": (K * E,)})
  return out


def check_config(path: str, cfg, n_vocab_tokens: int) -> None:
  c = cfg
  bad = []
  if min(c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.ff, c.vocab_size, c.max_seq_len) <= 0:
    bad.append("a non-positive size")
  elif c.n_heads % c.n_kv_heads:
    bad.append(f"head_count {c.n_heads} not a multiple of head_count_kv {c.n_kv_heads}")
  elif c.hd % 2:
    bad.append(f"odd head dimension {c.hd} (RoPE rotates pairs)")
  if not (math.isfinite(c.norm_eps) and c.norm_eps > 0) or not (math.isfinite(c.rope_theta) and c.rope_theta > 1):
    bad.append(f"norm eps {c.norm_eps} / rope theta {c.rope_theta} out of range")
  if c.vocab_size != n_vocab_tokens:
    bad.append(f"vocab_size {c.vocab_size} but {n_vocab_tokens} tokenizer tokens")
  if bad:
    raise GGUFError(f"{path}: inconsistent model metadata ({'; '.join(bad)}); {_fix(path)}")


def check_structure(path: str, info_tensors: dict, cfg, alignment: int, size: int, arch: str = "llama",
                    moe: Optional[MoE] = None) -> None:
  """Shapes vs the config, every tensor inside the file, aligned, and no two overlapping."""
  want = expected_shapes(cfg, arch, moe)
  opt = optional_shapes(cfg, arch)
  missing = [n for n in want if n not in info_tensors]
  if missing:
    raise GGUFError(f"{path} lacks tensors {missing[:4]}{'...' if len(missing) > 4 else ''}: incomplete or "
                    f"renamed by corruption; {_fix(path)}")
  for n, t in info_tensors.items():
    w = want.get(n, opt.get(n))
    if w is not None and tuple(t.shape) != tuple(w):
      raise GGUFError(f"{path}: tensor {n} has shape {tuple(t.shape)}, the metadata implies {tuple(w)}: "
                      f"corrupt or not a {arch} file; {_fix(path)}")
    if t.offset + t.nbytes > size:
      raise GGUFError(f"{path} is truncated: tensor {n} ends at byte {t.offset + t.nbytes} but the file has "
                      f"{size}; {_fix(path)}")
    if alignment and t.offset % alignment:
      raise GGUFError(f"{path}: tensor {n} starts at {t.offset}, not a multiple of the file's alignment "
                      f"{alignment}: the tensor index is corrupt; {_fix(path)}")
  spans = sorted((t.offset, t.offset + t.nbytes, n) for n, t in info_tensors.items())
  for (a0, b0, n0), (a1, _, n1) in zip(spans, spans[1:]):
    if a1 < b0:
      raise GGUFError(f"{path}: tensors {n0} and {n1} overlap in the file: the tensor index is corrupt; "
                      f"{_fix(path)}")


# {arch}.* features this runtime does not implement: refuse rather than compute something else.
_UNSUPPORTED = {
    "rope.scaling.type": lambda v: v not in (None, "none"),
    "rope.scale_linear": lambda v: v not in (None, 1.0),
    "rope.scaling.factor": lambda v: v not in (None, 1.0),
    "expert_shared_count": lambda v: v not in (None, 0),
    "expert_gating_func": lambda v: v not in (None, 1),  # 1: softmax
    "expert_weights_scale": lambda v: v not in (None, 0.0, 1.0),
    "leading_dense_block_count": lambda v: v not in (None, 0),
    "attention.clamp_kqv": lambda v: v is not None,
    "attention.scale": lambda v: v not in (None, 0.0),
    "logit_scale": lambda v: v not in (None, 1.0),
    "attention.key_length_mla": lambda v: v is not None,
}


def unsupported_features(path: str, fields: dict, cfg, arch: str = "llama", tensor_names=(), rope_dim=None,
                         moe: Optional[MoE] = None) -> list:
  """``fields``: the file's ``{arch}.*`` metadata with the prefix removed. Also every tensor the graph of
  ``arch`` does not read (a bias or norm llama.cpp would apply and we would not)."""
  out = [f"{arch}.{k}={fields[k]!r}" for k, bad in _UNSUPPORTED.items() if k in fields and bad(fields[k])]
  rd = fields.get("rope.dimension_count")
  if rd is not None and int(rd) != cfg.hd:
    out.append(f"{arch}.rope.dimension_count={rd} (partial RoPE; head dim {cfg.hd})")
  known = set(expected_shapes(cfg, arch, moe)) | set(optional_shapes(cfg, arch))
  out += [f"tensor {n}" for n in tensor_names if n not in known][:3]
  return out


def check_runnable(info) -> None:
  """What the numba runtime computes on: the RUNTIME_TYPES tensors and the llama / qwen2 / qwen3 graphs as
  llama.cpp runs them (no RoPE scaling other than rope_freqs, MoE only as softmax top-k routing without shared
  experts, no tensors the graph would ignore...)."""
  if info.unsupported:
    raise GGUFError(f"{info.path} uses features this runtime does not implement ({', '.join(info.unsupported)}); "
                    f"run it with llama.cpp")
  kinds = sorted({t.qtype for t in info.tensors.values() if t.qtype not in RUNTIME_TYPES})
  if kinds:
    bad = next(n for n, t in info.tensors.items() if t.qtype in kinds)
    raise GGUFError(f"{info.path} has {'/'.join(kinds)} tensors (first: {bad}), which this runtime cannot compute "
                    f"on (it runs {', '.join(RUNTIME_TYPES)}); re-quantise it with llama.cpp's quantiser (Q4_K_M, "
                    f"Q5_K_M, Q6_K, Q8_0, Q4_0) or run it with llama.cpp")
  from ondevice import simd_k
  if not simd_k.has_bf16() and any(t.qtype == "BF16" for t in info.tensors.values()):
    raise GGUFError(f"{info.path} has BF16 tensors: this runtime computes them with the AVX-512 BF16 instruction, "
                    f"which this CPU lacks; convert it to F16 or Q8_0 with llama.cpp's quantiser")
  tied = "output.weight" not in info.tensors
  for n, t in info.tensors.items():
    if len(t.shape) >= 2 and t.qtype in ("Q4_K", "Q4_0") and t.shape[-2] % 8 and (n != "token_embd.weight" or tied):
      raise GGUFError(f"{info.path}: {n} is {t.qtype} with {t.shape[-2]} rows, not a multiple of 8: llama.cpp "
                      f"computes it with other kernels than the repacked ones implemented here; re-quantise it")


def parse_crc(value) -> dict:
  if value is None:
    return {}
  try:
    d = json.loads(value)
    return {str(k): (int(v), None) if isinstance(v, int) else (int(v[0]), str(v[1])) for k, v in d.items()}
  except (ValueError, TypeError, AttributeError, IndexError):
    raise GGUFError(f"metadata {CRC_KEY} is not valid JSON: the header is corrupt; re-export or re-copy the file") \
        from None
