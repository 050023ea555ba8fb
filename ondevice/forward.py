"""The decoder forward pass on packed GGUF weights with a KV cache (llama, mistral, qwen2, qwen3 graphs).

Works on any subset of layers, so a ring device binds only its windows. Mixture-of-experts files (Mixtral-shaped
llama, qwen3moe) run their feed-forward blocks in ``moe.py`` (router, top-k, only the routed experts read).
Math follows llama.cpp's graphs:
RMSNorm (ggml's roundings), q/k/v projections (+ biases: qwen2; + per-head RMSNorm of q and k: qwen3), RoPE in
NORM mode (adjacent pairs; llama files' q/k rows are permuted, see framework/names.py) or NEOX mode (pairs i,
i + E/2: qwen2/qwen3), with Llama 3's rope_freqs factors, grouped-query attention, SwiGLU; quantised dots
quantise their activations as ggml does (matvec.py). Activations and the KV cache are f32.

Two paths: the matrices are repacked at load into SIMD planes and a step over all bound layers runs as one
numba call per thread (ondevice/planes.py; the exact, fast path). ``repack=False`` (ring devices with real
I/O, whose kernels must touch the file's pages) runs the numpy layer below on the mmap views
(ondevice/kernels.py; not llama.cpp-exact). Why not JAX: a jitted f32 JAX decode step of the same model is measured in
``ondevice.bench`` (``jax_f32``) and is several times slower than the planes path (README, Measured).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import numpy as np

from framework.config import ModelConfig
from ondevice import gguf_check, kernels, moe, planes
from ondevice.weights import MappedGGUF


@dataclasses.dataclass(frozen=True)
class QMat:
  """A packed (n_out, n_in) weight living in the mmap (the numpy path's matrices)."""
  qtype: str
  data: np.ndarray
  n_out: int
  n_in: int

  def __call__(self, x_TxI: np.ndarray) -> np.ndarray:
    return kernels.matmul(self.qtype, self.data, x_TxI, self.n_out, self.n_in)

  def rows(self, idx) -> np.ndarray:
    return kernels.dequantize_rows(self.qtype, self.data[np.asarray(idx)], self.n_in)


@dataclasses.dataclass(frozen=True)
class LayerW:
  """One block's tensors as mmap views (the numpy path; also what residency accounting sees). ``vec`` holds the
  vectors present (planes.VECTORS names: norms, q/k/v biases, q/k norms)."""
  mats: dict  # planes.SLOTS name -> QMat
  vec: dict


class KVCache:
  """Per-layer K/V rows [max_len, K, E] for the layers a process owns. Rolling back = writing at an
  earlier position next time (the forward only ever reads rows < pos0 + T). One array per K and V
  with the layers stacked in the order given; ``k[i]``/``v[i]`` are views of layer i's slice."""

  def __init__(self, cfg: ModelConfig, layers: Iterable[int], max_len: int):
    self.layer_ids = tuple(layers)
    self.max_len = max_len
    self.k_all = np.zeros((len(self.layer_ids), max_len, cfg.n_kv_heads, cfg.hd), np.float32)
    self.v_all = np.zeros_like(self.k_all)
    self.k = {i: self.k_all[j] for j, i in enumerate(self.layer_ids)}
    self.v = {i: self.v_all[j] for j, i in enumerate(self.layer_ids)}


rms_norm = planes.rms_norm  # ggml's roundings (they decide Q8_0 ties of the quantised embedding)


class RopeTable:
  def __init__(self, max_len: int, head_dim: int, theta: float, neox: bool = False, freq_factors=None):
    self.cos, self.sin = planes.rope_tables(max_len, head_dim, theta, freq_factors)  # ggml's tables, bit for bit
    self.neox = neox

  def apply(self, x_TxNxE: np.ndarray, pos0: int) -> np.ndarray:
    """llama.cpp NORM (adjacent pairs) or NEOX (pairs i, i + E/2) rotation at positions pos0 .. pos0+T-1."""
    T, E = x_TxNxE.shape[0], x_TxNxE.shape[-1]
    c, s = self.cos[pos0:pos0 + T, None, :], self.sin[pos0:pos0 + T, None, :]
    i0, i1 = (np.arange(E // 2), np.arange(E // 2) + E // 2) if self.neox else (np.arange(0, E, 2), np.arange(1, E, 2))
    x0, x1 = x_TxNxE[..., i0], x_TxNxE[..., i1]
    out = np.empty_like(x_TxNxE)
    out[..., i0] = x0 * c - x1 * s
    out[..., i1] = x0 * s + x1 * c
    return out


class GGUFLlama:
  """The model over a mapped GGUF (llama, mistral, qwen2, qwen3). ``layers`` limits which blocks are bound
  (ring devices)."""

  def __init__(self, mapped: MappedGGUF, layers: Optional[Iterable[int]] = None, head: bool = True,
               max_len: Optional[int] = None, repack: bool = True, expert_cache_mb: Optional[float] = None):
    """``repack``: copy the matrices once into SIMD planes (planes.py; the exact, fast path). False computes on
    the mmap views, so the file's pages are what the kernels touch (ring devices with real I/O).
    ``expert_cache_mb``: MoE files: MB of repacked quantised experts kept (None: all that were used; 0: none)."""
    gguf_check.check_runnable(mapped.info)
    self.mapped = mapped
    info = mapped.info
    self.repack = repack
    self.cfg: ModelConfig = info.cfg
    c = self.cfg
    self.layer_ids = list(range(c.n_layers) if layers is None else layers)
    self.max_len = max_len or c.max_seq_len
    self.experts = None
    if info.moe is not None:
      self.experts = moe.Experts(mapped, self.layer_ids,
                                 None if expert_cache_mb is None else int(expert_cache_mb * 2**20))
    ff = np.asarray(mapped.view("rope_freqs.weight"), np.float32) if "rope_freqs.weight" in info.tensors else None
    self.rope = RopeTable(self.max_len, c.hd, c.rope_theta, info.rope_neox, ff)
    self.layers = {i: self._layer(i) for i in self.layer_ids}
    packer = planes.pack_layers if self.experts is None else moe.pack_attention
    self.pack = packer(mapped, self.layer_ids) if (repack and planes.HAVE_NUMBA and self.layer_ids) else None
    self._teams: dict = {}
    self.has_head = head
    if head:
      self.tok_embd = self._mat("token_embd.weight")
      self.out_norm = np.asarray(mapped.view("output_norm.weight"), np.float32)
      out = self._mat("output.weight" if "output.weight" in info.tensors else "token_embd.weight")
      self.output = planes.Matrix(out.qtype, out.data, out.n_out, out.n_in) if (repack and planes.HAVE_NUMBA) \
          else out

  def _mat(self, name: str) -> QMat:
    t = self.mapped.info.tensors[name]
    return QMat(t.qtype, self.mapped.view(name), t.shape[0], t.shape[1])

  def _layer(self, i: int) -> LayerW:
    vec = {v: np.asarray(self.mapped.view(f"blk.{i}.{v}"), np.float32) for v in planes.VECTORS
           if f"blk.{i}.{v}" in self.mapped.info.tensors}
    return LayerW({s: self._mat(f"blk.{i}.{s}.weight") for s in planes.SLOTS
                   if f"blk.{i}.{s}.weight" in self.mapped.info.tensors}, vec)

  def team(self) -> "planes.Team":
    """The kernel threads for this model's pack at the current planes.set_threads (started on first use)."""
    n = min(planes.get_threads(), max(1, int(self.pack.desc[:, 4, 3].min())))
    t = self._teams.get(n)
    if t is None:
      c = self.cfg
      t = self._teams[n] = planes.Team(self.pack, n, c.n_heads, c.n_kv_heads, c.hd, c.norm_eps, self.rope.cos,
                                       self.rope.sin, self.rope.neox)
    return t

  def new_cache(self, layers: Optional[Iterable[int]] = None) -> KVCache:
    return KVCache(self.cfg, self.layer_ids if layers is None else layers, self.max_len)

  # ------------------------------------------------------------------ pieces
  def embed(self, tokens_T) -> np.ndarray:
    return self.tok_embd.rows(np.asarray(tokens_T, np.int64))

  def head(self, x_TxD: np.ndarray, batch_invariant: bool = False) -> np.ndarray:
    h = rms_norm(x_TxD, self.out_norm, self.cfg.norm_eps)
    if isinstance(self.output, planes.Matrix):
      return self.output(h, not batch_invariant)
    return self.output(h)

  def _moe(self, i: int, x_TxD: np.ndarray, batch_invariant: bool, last_only: bool) -> np.ndarray:
    """x + the MoE block of layer i (only the last row when only its result is used, as llama.cpp does)."""
    rows = slice(len(x_TxD) - 1, None) if last_only else slice(None)
    x = np.array(x_TxD, np.float32)
    h = rms_norm(x[rows], self.layers[i].vec["ffn_norm.weight"], self.cfg.norm_eps)
    x[rows] = self.experts.ffn(i, h, not batch_invariant) + x[rows]
    return x

  def layer(self, i: int, x_TxD: np.ndarray, pos0: int, cache: KVCache, batch_invariant: bool = False,
            last_only: bool = False) -> np.ndarray:
    c, w = self.cfg, self.layers[i]
    T, H, K, E = x_TxD.shape[0], c.n_heads, c.n_kv_heads, c.hd
    if pos0 + T > cache.max_len:
      raise ValueError(f"context overflow: position {pos0 + T} > max_len {cache.max_len}; raise --ctx")
    if self.pack is not None:
      j, cj = self.layer_ids.index(i), cache.layer_ids.index(i)
      x = planes.layers(self.team(), j, j + 1, x_TxD, cache.k_all[cj:cj + 1], cache.v_all[cj:cj + 1], pos0,
                        batch_invariant)
      return x if self.experts is None else self._moe(i, x, batch_invariant, last_only)
    m, v = w.mats, w.vec
    h_TxD = rms_norm(x_TxD, v["attn_norm.weight"], c.norm_eps)
    qkv = []
    for s, n in (("attn_q", H), ("attn_k", K), ("attn_v", K)):
      y = m[s](h_TxD)
      if f"{s}.bias" in v:
        y = y + v[f"{s}.bias"]
      y = y.reshape(T, n, E)
      if f"{s}_norm.weight" in v:
        y = rms_norm(y.reshape(T * n, E), v[f"{s}_norm.weight"], c.norm_eps).reshape(T, n, E)
      qkv.append(y)
    q_TxHxE, k_TxKxE = self.rope.apply(qkv[0], pos0), self.rope.apply(qkv[1], pos0)
    cache.k[i][pos0:pos0 + T] = k_TxKxE
    cache.v[i][pos0:pos0 + T] = qkv[2]
    S = pos0 + T
    k_SxKxE, v_SxKxE = cache.k[i][:S], cache.v[i][:S]
    q_KxGxTxE = q_TxHxE.reshape(T, K, H // K, E).transpose(1, 2, 0, 3)
    s_KxGxTxS = np.matmul(q_KxGxTxE, k_SxKxE.transpose(1, 2, 0)[:, None]) * np.float32(1.0 / np.sqrt(E))
    causal_TxS = np.arange(S)[None, :] <= (pos0 + np.arange(T))[:, None]
    s_KxGxTxS = np.where(causal_TxS, s_KxGxTxS, np.float32(-np.inf))
    s_KxGxTxS = np.exp(s_KxGxTxS - s_KxGxTxS.max(axis=-1, keepdims=True))
    p_KxGxTxS = s_KxGxTxS / s_KxGxTxS.sum(axis=-1, keepdims=True)
    o_KxGxTxE = np.matmul(p_KxGxTxS, v_SxKxE.transpose(1, 0, 2)[:, None])
    o_TxHE = o_KxGxTxE.transpose(2, 0, 1, 3).reshape(T, H * E)
    x_TxD = x_TxD + m["attn_output"](o_TxHE)
    if self.experts is not None:
      return self._moe(i, x_TxD, batch_invariant, last_only)
    h_TxD = rms_norm(x_TxD, v["ffn_norm.weight"], c.norm_eps)
    g_TxF, u_TxF = m["ffn_gate"](h_TxD), m["ffn_up"](h_TxD)
    a_TxF = g_TxF / (np.float32(1.0) + np.exp(-g_TxF)) * u_TxF
    return x_TxD + m["ffn_down"](a_TxF)

  def run_layers(self, x_TxD: np.ndarray, pos0: int, layers: Iterable[int], cache: KVCache,
                 batch_invariant: bool = False, last_only: bool = False) -> np.ndarray:
    """The given layers in order. A run of consecutive bound layers whose caches are consecutive too is one
    fused call (planes.layers); ``batch_invariant``: see there (speculative verification). ``last_only``: only
    the last row's result will be used (llama.cpp computes the model's last feed-forward block for the rows
    whose logits are wanted; the other rows come back, computed the same way, unused)."""
    layers = list(layers)
    if pos0 + x_TxD.shape[0] > cache.max_len:
      raise ValueError(f"context overflow: position {pos0 + x_TxD.shape[0]} > max_len {cache.max_len}; raise --ctx")
    if self.experts is not None:  # attention in the fused step, the MoE block outside it, layer by layer
      for i in layers:
        x_TxD = self.layer(i, x_TxD, pos0, cache, batch_invariant, last_only and i == self.cfg.n_layers - 1)
      return x_TxD
    if self.pack is not None and layers and all(i in self.layer_ids and i in cache.layer_ids for i in layers):
      j, cj = self.layer_ids.index(layers[0]), cache.layer_ids.index(layers[0])
      n = len(layers)
      if self.layer_ids[j:j + n] == layers and list(cache.layer_ids[cj:cj + n]) == layers:
        last = self.cfg.n_layers - 1
        cut = layers.index(last) if last_only and last in layers else -1
        return planes.layers(self.team(), j, j + n, x_TxD, cache.k_all[cj:cj + n], cache.v_all[cj:cj + n], pos0,
                             batch_invariant, cut)
    for i in layers:
      x_TxD = self.layer(i, x_TxD, pos0, cache, batch_invariant)
    return x_TxD

  def forward(self, tokens_T, pos0: int, cache: KVCache, batch_invariant: bool = False,
              last_only: bool = False) -> np.ndarray:
    """Logits T x V for tokens at positions pos0.. (all bound layers in order); ``last_only``: 1 x V, the last
    token's, computed as llama.cpp computes them when only they are requested (run_layers)."""
    x = self.run_layers(self.embed(tokens_T), pos0, self.layer_ids, cache, batch_invariant, last_only)
    return self.head(x[-1:] if last_only else x, batch_invariant)


def greedy_generate(model: GGUFLlama, prompt_ids, n_new: int, stop_id: Optional[int] = None,
                    on_token=None) -> list:
  """Plain greedy decoding (prefill once, then one token per step)."""
  cache = model.new_cache()
  logits = model.forward(prompt_ids, 0, cache)
  pos, out = len(prompt_ids), []
  for _ in range(n_new):
    tok = int(np.argmax(logits[-1]))
    if stop_id is not None and tok == stop_id:
      break
    out.append(tok)
    if on_token:
      on_token(tok)
    if pos >= model.max_len:
      break
    logits = model.forward([tok], pos, cache)
    pos += 1
  return out
