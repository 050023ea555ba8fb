"""Llama forward pass on packed GGUF weights with a KV cache.

Works on any subset of layers, so a ring device binds only its windows. Math follows llama.cpp's
llama graph: RMSNorm (ggml's roundings), RoPE NORM mode (adjacent pairs; q/k rows were permuted at
export, see framework/names.py), grouped-query attention, SwiGLU; Q8_0/Q4_0 dots quantise their
activations to Q8_0 as ggml does. Activations and the KV cache are f32.

Two paths: Q8_0/Q4_0 files are repacked at load into SIMD planes and every block runs as one numba
call (ondevice/planes.py; the fast path). F32/F16 files, and ``repack=False`` (ring devices with real
I/O, whose kernels must touch the file's pages), run the numpy layer below on the mmap views
(ondevice/kernels.py). Why not JAX: a jitted f32 JAX decode step of the same model is measured in
``ondevice.bench`` (``jax_f32``) and is several times slower than the planes path (README, Measured).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Optional

import numpy as np

from framework.config import ModelConfig
from ondevice import gguf_check, kernels, planes
from ondevice.weights import MappedGGUF


@dataclasses.dataclass(frozen=True)
class QMat:
  """A packed (n_out, n_in) weight living in the mmap."""
  qtype: str
  data: np.ndarray
  n_out: int
  n_in: int

  def __call__(self, x_TxI: np.ndarray) -> np.ndarray:
    return kernels.matmul(self.qtype, self.data, x_TxI, self.n_out, self.n_in)

  def rows(self, idx) -> np.ndarray:
    return kernels.dequantize_rows(self.qtype, self.data[np.asarray(idx)], self.n_in)


@dataclasses.dataclass(frozen=True)
class Linear:
  """Matrices that read the same input (wq/wk/wv, or w_gate/w_up, or one): ``lin(x) -> [x @ W_i.T]``.

  Q8_0/Q4_0 members are repacked into one ``planes.Planes`` (one kernel call, one activation
  quantisation) unless ``packed`` is None, in which case each runs on its mmap view."""
  mats: tuple  # QMat per member (mmap views; also what residency accounting sees)
  packed: Optional[planes.Planes] = None

  @staticmethod
  def of(mats, repack: bool, interleave: bool = False) -> "Linear":
    qt = {m.qtype for m in mats}
    ok = (repack and planes.HAVE_NUMBA and len(qt) == 1 and next(iter(qt)) in planes.PLANE_BYTES
          and all(m.n_in % planes.QK == 0 for m in mats) and len({m.n_in for m in mats}) == 1)
    p = planes.repack(mats[0].qtype, [m.data for m in mats], mats[0].n_in, interleave) if ok else None
    return Linear(tuple(mats), p)

  def __call__(self, x_TxI: np.ndarray) -> list:
    if self.packed is not None:
      return self.packed(x_TxI)
    return [m(x_TxI) for m in self.mats]


@dataclasses.dataclass(frozen=True)
class LayerW:
  attn_norm: np.ndarray
  qkv: Linear
  wo: Linear
  ffn_norm: np.ndarray
  gate_up: Linear
  down: Linear

  @functools.cached_property  # per-token hot path; frozen dataclasses allow it (writes __dict__)
  def fused(self) -> bool:
    """All four projections are planes: the whole block runs as one numba call (planes.layer)."""
    return all(m.packed is not None for m in (self.qkv, self.wo, self.gate_up, self.down))


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
  def __init__(self, max_len: int, head_dim: int, theta: float):
    self.cos, self.sin = planes.rope_tables(max_len, head_dim, theta)  # ggml's tables, bit for bit

  def apply(self, x_TxNxE: np.ndarray, pos0: int) -> np.ndarray:
    """Adjacent-pair rotation (llama.cpp NORM mode) at positions pos0 .. pos0+T-1."""
    T = x_TxNxE.shape[0]
    c, s = self.cos[pos0:pos0 + T, None, :], self.sin[pos0:pos0 + T, None, :]
    x0, x1 = x_TxNxE[..., 0::2], x_TxNxE[..., 1::2]
    out = np.empty_like(x_TxNxE)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


class GGUFLlama:
  """The model over a mapped GGUF. ``layers`` limits which blocks are bound (ring devices)."""

  def __init__(self, mapped: MappedGGUF, layers: Optional[Iterable[int]] = None, head: bool = True,
               max_len: Optional[int] = None, repack: bool = True):
    """``repack``: copy Q8_0/Q4_0 matrices once into SIMD planes (kernels.repack; ~6x faster mat-vecs,
    +11%/+6% bytes of anonymous memory). False computes on the mmap views, so the file's pages are
    what the kernels touch (ring devices with real I/O)."""
    gguf_check.check_runnable(mapped.info)
    self.mapped = mapped
    self.repack = repack
    self.cfg: ModelConfig = mapped.info.cfg
    c = self.cfg
    self.layer_ids = list(range(c.n_layers) if layers is None else layers)
    self.max_len = max_len or c.max_seq_len
    self.rope = RopeTable(self.max_len, c.hd, c.rope_theta)
    self.layers = {i: self._layer(i) for i in self.layer_ids}
    self.stack = self._stack()
    self._teams: dict = {}
    self.has_head = head
    if head:
      self.tok_embd = self._mat("token_embd.weight")
      self.out_norm = np.asarray(mapped.view("output_norm.weight"), np.float32)
      out = self._mat("output.weight" if "output.weight" in mapped.info.tensors else "token_embd.weight")
      self.output = Linear.of([out], repack)

  def _mat(self, name: str) -> QMat:
    t = self.mapped.info.tensors[name]
    return QMat(t.qtype, self.mapped.view(name), t.shape[0], t.shape[1])

  def _layer(self, i: int) -> LayerW:
    m = lambda s: self._mat(f"blk.{i}.{s}.weight")  # noqa: E731
    v = lambda s: np.asarray(self.mapped.view(f"blk.{i}.{s}.weight"), np.float32)  # noqa: E731
    lin = lambda *ss, il=False: Linear.of([m(s) for s in ss], self.repack, il)  # noqa: E731
    return LayerW(v("attn_norm"), lin("attn_q", "attn_k", "attn_v"), lin("attn_output"), v("ffn_norm"),
                  lin("ffn_gate", "ffn_up", il=True), lin("ffn_down"))

  def _stack(self) -> Optional[planes.Stack]:
    """Stack all bound blocks' planes so run_layers over them is one numba call; the per-layer
    Planes become views of the stack (no second copy)."""
    ws = [self.layers[i] for i in self.layer_ids]
    if not ws or not all(w.fused for w in ws):
      return None
    r = planes.stack([(w.qkv.packed, w.wo.packed, w.gate_up.packed, w.down.packed) for w in ws],
                     [w.attn_norm for w in ws], [w.ffn_norm for w in ws])
    if r is None:
      return None
    st, views = r
    for i, w, v in zip(self.layer_ids, ws, views):
      self.layers[i] = dataclasses.replace(
          w, qkv=dataclasses.replace(w.qkv, packed=v[0]), wo=dataclasses.replace(w.wo, packed=v[1]),
          gate_up=dataclasses.replace(w.gate_up, packed=v[2]), down=dataclasses.replace(w.down, packed=v[3]))
    return st

  def team(self) -> "planes.Team":
    """The kernel threads for this model's stack at the current planes.set_threads (started on first use)."""
    n = min(planes.get_threads(), max(1, self.stack.gate_up[0].shape[1] // 2))
    t = self._teams.get(n)
    if t is None:
      c = self.cfg
      t = self._teams[n] = planes.Team(self.stack, n, c.n_heads, c.n_kv_heads, c.hd, c.norm_eps, self.rope.cos,
                                       self.rope.sin)
    return t

  def new_cache(self, layers: Optional[Iterable[int]] = None) -> KVCache:
    return KVCache(self.cfg, self.layer_ids if layers is None else layers, self.max_len)

  # ------------------------------------------------------------------ pieces
  def embed(self, tokens_T) -> np.ndarray:
    return self.tok_embd.rows(np.asarray(tokens_T, np.int64))

  def head(self, x_TxD: np.ndarray) -> np.ndarray:
    return self.output(rms_norm(x_TxD, self.out_norm, self.cfg.norm_eps))[0]

  def layer(self, i: int, x_TxD: np.ndarray, pos0: int, cache: KVCache, batch_invariant: bool = False) -> np.ndarray:
    c, w = self.cfg, self.layers[i]
    T, H, K, E = x_TxD.shape[0], c.n_heads, c.n_kv_heads, c.hd
    if pos0 + T > cache.max_len:
      raise ValueError(f"context overflow: position {pos0 + T} > max_len {cache.max_len}; raise --ctx")
    if self.stack is not None:
      j, cj = self.layer_ids.index(i), cache.layer_ids.index(i)
      return planes.layers(self.team(), j, j + 1, x_TxD, cache.k_all[cj:cj + 1], cache.v_all[cj:cj + 1], pos0,
                           batch_invariant)
    h_TxD = rms_norm(x_TxD, w.attn_norm, c.norm_eps)
    q_TxHE, k_TxKE, v_TxKE = w.qkv(h_TxD)
    q_TxHxE = self.rope.apply(q_TxHE.reshape(T, H, E), pos0)
    k_TxKxE = self.rope.apply(k_TxKE.reshape(T, K, E), pos0)
    cache.k[i][pos0:pos0 + T] = k_TxKxE
    cache.v[i][pos0:pos0 + T] = v_TxKE.reshape(T, K, E)
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
    x_TxD = x_TxD + w.wo(o_TxHE)[0]
    h_TxD = rms_norm(x_TxD, w.ffn_norm, c.norm_eps)
    g_TxF, u_TxF = w.gate_up(h_TxD)
    a_TxF = g_TxF / (np.float32(1.0) + np.exp(-g_TxF)) * u_TxF
    return x_TxD + w.down(a_TxF)[0]

  def run_layers(self, x_TxD: np.ndarray, pos0: int, layers: Iterable[int], cache: KVCache,
                 batch_invariant: bool = False) -> np.ndarray:
    """The given layers in order. A run of consecutive bound layers whose caches are consecutive too is one
    fused call (planes.layers); ``batch_invariant``: see there (speculative verification)."""
    layers = list(layers)
    if pos0 + x_TxD.shape[0] > cache.max_len:
      raise ValueError(f"context overflow: position {pos0 + x_TxD.shape[0]} > max_len {cache.max_len}; raise --ctx")
    if self.stack is not None and layers and all(i in self.layer_ids and i in cache.layer_ids for i in layers):
      j, cj = self.layer_ids.index(layers[0]), cache.layer_ids.index(layers[0])
      n = len(layers)
      if self.layer_ids[j:j + n] == layers and list(cache.layer_ids[cj:cj + n]) == layers:
        return planes.layers(self.team(), j, j + n, x_TxD, cache.k_all[cj:cj + n], cache.v_all[cj:cj + n], pos0,
                             batch_invariant)
    for i in layers:
      x_TxD = self.layer(i, x_TxD, pos0, cache, batch_invariant)
    return x_TxD

  def forward(self, tokens_T, pos0: int, cache: KVCache, batch_invariant: bool = False) -> np.ndarray:
    """Logits T x V for tokens at positions pos0.. (all bound layers in order)."""
    x = self.embed(tokens_T)
    return self.head(self.run_layers(x, pos0, self.layer_ids, cache, batch_invariant))


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
