"""Llama forward pass on packed GGUF weights with a KV cache (numpy + numba kernels).

Works on any subset of layers, so a ring device binds only its windows. Math follows llama.cpp's
llama graph: RMSNorm, RoPE NORM mode (adjacent pairs; q/k rows were permuted at export, see
framework/names.py), grouped-query attention, SwiGLU. Activations and the KV cache are f32.

Why not JAX here: a jitted f32 JAX decode step of the same model is measured in ``ondevice.bench``
(backend 'jax-f32'); the packed-weight kernels (ondevice/kernels.py) are what make quantised files
fast on CPU, and they are numba, so the layer loop around them is numpy.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import numpy as np

from framework.config import ModelConfig
from ondevice import kernels
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
class LayerW:
  attn_norm: np.ndarray
  wq: QMat
  wk: QMat
  wv: QMat
  wo: QMat
  ffn_norm: np.ndarray
  w_gate: QMat
  w_up: QMat
  w_down: QMat


class KVCache:
  """Per-layer K/V rows [max_len, K, E] for the layers a process owns. Rolling back = writing at an
  earlier position next time (the forward only ever reads rows < pos0 + T)."""

  def __init__(self, cfg: ModelConfig, layers: Iterable[int], max_len: int):
    shape = (max_len, cfg.n_kv_heads, cfg.hd)
    self.max_len = max_len
    self.k = {i: np.zeros(shape, np.float32) for i in layers}
    self.v = {i: np.zeros(shape, np.float32) for i in layers}


def rms_norm(x_TxD: np.ndarray, w_D: np.ndarray, eps: float) -> np.ndarray:
  ms = np.mean(x_TxD * x_TxD, axis=-1, keepdims=True)
  return (x_TxD * (np.float32(1.0) / np.sqrt(ms + np.float32(eps)))) * w_D


class RopeTable:
  def __init__(self, max_len: int, head_dim: int, theta: float):
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    ang = np.arange(max_len, dtype=np.float32)[:, None] * inv[None, :].astype(np.float32)
    self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

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
               max_len: Optional[int] = None):
    self.mapped = mapped
    self.cfg: ModelConfig = mapped.info.cfg
    c = self.cfg
    self.layer_ids = list(range(c.n_layers) if layers is None else layers)
    self.max_len = max_len or c.max_seq_len
    self.rope = RopeTable(self.max_len, c.hd, c.rope_theta)
    self.layers = {i: self._layer(i) for i in self.layer_ids}
    self.has_head = head
    if head:
      self.tok_embd = self._mat("token_embd.weight")
      self.out_norm = np.asarray(mapped.view("output_norm.weight"), np.float32)
      self.output = self._mat("output.weight" if "output.weight" in mapped.info.tensors else "token_embd.weight")

  def _mat(self, name: str) -> QMat:
    t = self.mapped.info.tensors[name]
    return QMat(t.qtype, self.mapped.view(name), t.shape[0], t.shape[1])

  def _layer(self, i: int) -> LayerW:
    m = lambda s: self._mat(f"blk.{i}.{s}.weight")  # noqa: E731
    v = lambda s: np.asarray(self.mapped.view(f"blk.{i}.{s}.weight"), np.float32)  # noqa: E731
    return LayerW(v("attn_norm"), m("attn_q"), m("attn_k"), m("attn_v"), m("attn_output"), v("ffn_norm"),
                  m("ffn_gate"), m("ffn_up"), m("ffn_down"))

  def new_cache(self, layers: Optional[Iterable[int]] = None) -> KVCache:
    return KVCache(self.cfg, self.layer_ids if layers is None else layers, self.max_len)

  # ------------------------------------------------------------------ pieces
  def embed(self, tokens_T) -> np.ndarray:
    return self.tok_embd.rows(np.asarray(tokens_T, np.int64))

  def head(self, x_TxD: np.ndarray) -> np.ndarray:
    return self.output(rms_norm(x_TxD, self.out_norm, self.cfg.norm_eps))

  def layer(self, i: int, x_TxD: np.ndarray, pos0: int, cache: KVCache) -> np.ndarray:
    c, w = self.cfg, self.layers[i]
    T, H, K, E = x_TxD.shape[0], c.n_heads, c.n_kv_heads, c.hd
    if pos0 + T > cache.max_len:
      raise ValueError(f"context overflow: position {pos0 + T} > max_len {cache.max_len}; raise --ctx")
    h_TxD = rms_norm(x_TxD, w.attn_norm, c.norm_eps)
    q_TxHxE = self.rope.apply(w.wq(h_TxD).reshape(T, H, E), pos0)
    k_TxKxE = self.rope.apply(w.wk(h_TxD).reshape(T, K, E), pos0)
    cache.k[i][pos0:pos0 + T] = k_TxKxE
    cache.v[i][pos0:pos0 + T] = w.wv(h_TxD).reshape(T, K, E)
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
    x_TxD = x_TxD + w.wo(o_TxHE)
    h_TxD = rms_norm(x_TxD, w.ffn_norm, c.norm_eps)
    g_TxF = w.w_gate(h_TxD)
    a_TxF = g_TxF / (np.float32(1.0) + np.exp(-g_TxF)) * w.w_up(h_TxD)
    return x_TxD + w.w_down(a_TxF)

  def run_layers(self, x_TxD: np.ndarray, pos0: int, layers: Iterable[int], cache: KVCache) -> np.ndarray:
    for i in layers:
      x_TxD = self.layer(i, x_TxD, pos0, cache)
    return x_TxD

  def forward(self, tokens_T, pos0: int, cache: KVCache) -> np.ndarray:
    """Logits T x V for tokens at positions pos0.. (all bound layers in order)."""
    x = self.embed(tokens_T)
    return self.head(self.run_layers(x, pos0, self.layer_ids, cache))


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
