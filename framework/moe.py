"""Mixture-of-experts routing and dispatch (``model.n_experts > 0``), as pure functions of arrays.

framework/layers.py's ``MoE`` layer holds the parameters and calls these; they know nothing of Flax.

Shapes: N tokens (B x T flattened), D d_model, E experts (``El`` of them on this device), k experts per token,
F one expert's width (its tensor-parallel shard), A = N x k assignments (token, expert).

* :func:`route`: router logits -> the k experts of each token and their gate weights. ``softmax`` (Mixtral,
  Qwen3-MoE): top-k of the softmax over the experts, renormalised over the k when ``norm_topk``; ``sigmoid``
  (DeepSeek-V3): top-k of per-expert sigmoid scores, renormalised.
* :func:`balance`: the load-balancing loss of one layer, per sequence (DeepSeek-V3's sequence-wise balance loss;
  the Switch / GShard loss computed over one sequence): ``E/k x sum_e f_e P_e`` with ``f_e`` the fraction of the
  sequence's assignments routed to ``e`` and ``P_e`` its mean routing probability. Per sequence, the loss does not
  depend on how a batch is split over devices, so every layout computes the same value as one device; under
  sequence parallelism the two statistics are summed over the ``sequence`` axis first.
* :func:`dropless`: every assignment is computed. Assignments are sorted by expert and each expert's rows go
  through its weights in one grouped matmul (``jax.lax.ragged_dot``: MegaBlocks' formulation; XLA lowers it to
  a grouped GEMM on GPU / TPU). With expert parallelism (``ep`` > 1) each device first sends every assignment to
  the device holding its expert (``all_to_all`` over the ``expert`` axis) and the results come back the same
  way. XLA:CPU has no ``ragged_all_to_all``, so the exchange uses fixed buffers sized for the worst case (all of a
  device's assignments to one peer): ``ep`` times the bytes a ragged exchange would move.
* :func:`capacity`: GShard / Switch dispatch. Each expert takes at most ``C = ceil(capacity_factor x A / E)``
  assignments from each device, in token order; the rest are dropped (their gate contributes nothing; the
  residual stream carries the token on) and counted. Dispatch and combine are scatters / gathers into an
  ``E x C x D`` buffer, the experts one batched matmul, and with expert parallelism the buffer is exchanged by
  ``all_to_all`` (fixed size: ``C`` is the capacity).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np


def route(logits_NxE, k: int, kind: str, norm_topk: bool, bias_E=None):
  """(gate weights N x k, expert ids N x k, routing probabilities N x E) in float32. ``bias_E`` (DeepSeek-V3's
  auxiliary-loss-free balancing): added to the scores to *select* the k experts only; the gate weights are the
  unbiased scores of the selected experts, and no gradient reaches the bias."""
  logits = logits_NxE.astype(jnp.float32)
  scores = jax.nn.sigmoid(logits) if kind == "sigmoid" else jax.nn.softmax(logits, axis=-1)
  if bias_E is None:
    w_NxK, ids_NxK = jax.lax.top_k(scores, k)
  else:
    bias = jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    _, ids_NxK = jax.lax.top_k(scores + bias.reshape((1,) * (scores.ndim - 1) + bias.shape), k)
    w_NxK = jnp.take_along_axis(scores, ids_NxK, axis=-1)
  if kind == "sigmoid":
    w_NxK = w_NxK / (jnp.sum(w_NxK, axis=-1, keepdims=True) + 1e-20)
    return w_NxK, ids_NxK, scores / jnp.sum(scores, axis=-1, keepdims=True)
  if norm_topk:
    w_NxK = w_NxK / jnp.sum(w_NxK, axis=-1, keepdims=True)
  return w_NxK, ids_NxK, scores


def expert_counts(ids_BxTxK, n_experts: int):
  """Assignments per sequence and expert, B x E (float32)."""
  one_hot = jax.nn.one_hot(ids_BxTxK, n_experts, dtype=jnp.float32)
  return jnp.sum(one_hot, axis=(1, 2))


def balance(ids_BxTxK, probs_BxTxE, seq_len: int, sequence_axis: Optional[str] = None):
  """Sum over this device's sequences of each sequence's balance loss ``E/k x sum_e f_e P_e`` (float32 scalar).
  ``seq_len``: the whole sequence's length; ``sequence_axis``: the mesh axis it is split over (or None)."""
  e, k = probs_BxTxE.shape[-1], ids_BxTxK.shape[-1]
  counts_BxE = jax.lax.stop_gradient(expert_counts(ids_BxTxK, e))
  psum_BxE = jnp.sum(probs_BxTxE, axis=1)
  if sequence_axis is not None:
    counts_BxE = jax.lax.psum(counts_BxE, sequence_axis)
    psum_BxE = jax.lax.psum(psum_BxE, sequence_axis)
  f_BxE = counts_BxE / (seq_len * k)
  p_BxE = psum_BxE / seq_len
  return e * jnp.sum(f_BxE * p_BxE)


def _sort_by_expert(ids_A, n_groups: int):
  """(order: assignments sorted by group, stable; group sizes G)."""
  order_A = jnp.argsort(ids_A, stable=True)
  sizes_G = jnp.sum(ids_A[:, None] == jnp.arange(n_groups, dtype=ids_A.dtype)[None, :], axis=0, dtype=jnp.int32)
  return order_A, sizes_G


def dropless(x_NxD, ids_NxK, w_NxK, experts: Callable, n_experts: int, ep_axis: Optional[str] = None,
             ep: int = 1, tag: Callable = lambda y: y):
  """Routed output N x D. ``experts(x_MxD, group_sizes_El) -> y_MxD`` applies this device's ``El = E / ep``
  experts to rows grouped by local expert (rows past the groups' total are padding and come out zero).
  ``tag``: applied to the experts' outputs once they are back on this device (a remat name: the backward then
  keeps them rather than exchanging them again)."""
  n, d = x_NxD.shape
  k = ids_NxK.shape[1]
  ids_A = ids_NxK.reshape(-1)
  order_A, sizes_E = _sort_by_expert(ids_A, n_experts)
  x_AxD = jnp.take(x_NxD, order_A // k, axis=0)  # assignment rows, sorted by expert
  if ep == 1:
    y_AxD = experts(x_AxD, sizes_E)
  else:
    y_AxD = _exchange(x_AxD, ids_A[order_A], sizes_E, experts, n_experts // ep, ep_axis, ep)
  y_sorted = jnp.zeros_like(y_AxD).at[order_A].set(tag(y_AxD))  # back to (token, slot) order
  return jnp.einsum("nkd,nk->nd", y_sorted.reshape(n, k, d), w_NxK.astype(y_sorted.dtype))


def _exchange(x_AxD, ids_A, sizes_E, experts: Callable, el: int, ep_axis: str, ep: int):
  """Expert parallelism of :func:`dropless`: sorted assignments -> the devices holding their experts -> back."""
  a, d = x_AxD.shape
  dest_A = ids_A // el
  starts_R = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(jnp.sum(sizes_E.reshape(ep, el), axis=1))[:-1]])
  slot_A = jnp.arange(a, dtype=jnp.int32) - starts_R[dest_A]  # position inside the destination's block
  send_RxAxD = jnp.zeros((ep, a, d), x_AxD.dtype).at[dest_A, slot_A].set(x_AxD)
  send_ids_RxA = jnp.full((ep, a), el, ids_A.dtype).at[dest_A, slot_A].set(ids_A - dest_A * el)  # el = padding
  recv_RxAxD = jax.lax.all_to_all(send_RxAxD, ep_axis, 0, 0, tiled=True)
  recv_ids_M = jax.lax.all_to_all(send_ids_RxA, ep_axis, 0, 0, tiled=True).reshape(-1)
  order_M, sizes_El = _sort_by_expert(recv_ids_M, el)  # padding (id el) sorts last, outside every group
  y_MxD = experts(jnp.take(recv_RxAxD.reshape(ep * a, d), order_M, axis=0), sizes_El)
  y_MxD = jnp.zeros_like(y_MxD).at[order_M].set(y_MxD)
  back_RxAxD = jax.lax.all_to_all(y_MxD.reshape(ep, a, d), ep_axis, 0, 0, tiled=True)
  return back_RxAxD[dest_A, slot_A]


def tensor_parallel(experts: Callable, axis: str, n: int, grouped: bool) -> Callable:
  """``experts`` (its weights F-sharded over ``axis``) for Megatron-Core's expert tensor parallelism under
  sequence parallelism, where each of the ``n`` tensor ranks dispatched its own chunk of the sequence: the ranks
  all-gather the rows they received, apply their F shard to all of them (partial sums) and reduce-scatter, so each
  gets the whole result for its own rows. ``grouped``: rows grouped by expert (:func:`dropless`: one grouped matmul
  per rank's block, each grouped on its own); else the capacity buffer E x C x D (gathered along C)."""
  if grouped:
    def run(x_MxD, sizes):
      x_RxMxD, sizes_RxG = jax.lax.all_gather(x_MxD, axis), jax.lax.all_gather(sizes, axis)
      y_RxMxD = jnp.stack([experts(x_RxMxD[r], sizes_RxG[r]) for r in range(n)])
      return jax.lax.psum_scatter(y_RxMxD, axis, scatter_dimension=0)
    return run

  def run_buffer(x_ExCxD):
    y_ExCxD = experts(jax.lax.all_gather(x_ExCxD, axis, axis=1, tiled=True))
    return jax.lax.psum_scatter(y_ExCxD, axis, scatter_dimension=1, tiled=True)
  return run_buffer


def capacity_of(n_assignments: int, n_experts: int, factor: float) -> int:
  """Slots per expert per device: ``ceil(factor x assignments / experts)``."""
  return max(1, math.ceil(factor * n_assignments / n_experts))


def capacity(x_NxD, ids_NxK, w_NxK, experts: Callable, n_experts: int, factor: float,
             ep_axis: Optional[str] = None, ep: int = 1, tag: Callable = lambda y: y):
  """(routed output N x D, assignments dropped on this device). ``experts(x_ExCxD) -> y_ExCxD`` applies this
  device's ``El`` experts, expert ``j`` to row block ``j`` (``ep x C`` rows each under expert parallelism);
  ``tag`` as in :func:`dropless`."""
  n, d = x_NxD.shape
  k = ids_NxK.shape[1]
  ids_A = ids_NxK.reshape(-1)
  c = capacity_of(n * k, n_experts, factor)
  order_A, sizes_E = _sort_by_expert(ids_A, n_experts)
  starts_E = jnp.cumsum(sizes_E) - sizes_E
  pos_sorted = jnp.arange(n * k, dtype=jnp.int32) - starts_E[ids_A[order_A]]
  pos_A = jnp.zeros_like(pos_sorted).at[order_A].set(pos_sorted)  # arrival order within the expert
  kept_A = pos_A < c
  slot_A = jnp.where(kept_A, pos_A, c)  # c is out of range: a dropped assignment writes nowhere
  x_AxD = jnp.repeat(x_NxD, k, axis=0)
  buf_ExCxD = jnp.zeros((n_experts, c, d), x_NxD.dtype).at[ids_A, slot_A].set(x_AxD, mode="drop")
  if ep == 1:
    out_ExCxD = experts(buf_ExCxD)
  else:
    el = n_experts // ep
    recv = jax.lax.all_to_all(buf_ExCxD.reshape(ep, el, c, d), ep_axis, 0, 0, tiled=True)  # R(src) x El x C x D
    out = experts(recv.transpose(1, 0, 2, 3).reshape(el, ep * c, d))
    out = out.reshape(el, ep, c, d).transpose(1, 0, 2, 3)
    out_ExCxD = jax.lax.all_to_all(out, ep_axis, 0, 0, tiled=True).reshape(n_experts, c, d)
  y_AxD = tag(out_ExCxD).at[ids_A, slot_A].get(mode="fill", fill_value=0)
  y = jnp.einsum("nkd,nk->nd", y_AxD.reshape(n, k, d), w_NxK.astype(y_AxD.dtype))
  return y, jnp.sum(~kept_A).astype(jnp.float32)


def collected(moe_vars, name: str) -> list:
  """The arrays a model's ``moe`` collection holds under ``name`` (``aux``, ``load``, ``dropped``), layer order."""
  out = []

  def walk(tree):
    for key in sorted(tree, key=lambda s: (len(s), s)):  # layers_2 before layers_10
      value = tree[key]
      if key == name:
        out.extend(value if isinstance(value, tuple) else (value,))
      elif isinstance(value, dict) or hasattr(value, "items"):
        walk(value)
  walk(moe_vars)
  return out


def aux_loss(moe_vars, coef: float, n_layers: int, n_seqs: float):
  """The load-balancing term added to the mean cross-entropy: ``coef`` x the mean over layers and sequences of
  the per-sequence balance loss, given the sums a model sowed over ``n_seqs`` sequences (float32 scalar)."""
  parts = collected(moe_vars, "aux")
  if not parts or not coef:
    return jnp.zeros((), jnp.float32)
  return coef * sum(jnp.sum(p) for p in parts) / (n_layers * n_seqs)


def layer_load(moe_vars, n_experts: int):
  """Assignments per layer and expert, L x E, from a model's ``moe`` collection (None without MoE layers)."""
  parts = collected(moe_vars, "load")
  if not parts:
    return None
  return jnp.concatenate([p.reshape(-1, n_experts) for p in parts])


def imbalance(load_LxE, expert_shards: int = 1) -> float:
  """How much slower than a balanced router a layer's expert work runs, from measured assignments (L x E, e.g.
  ``StepMetrics.expert_load``): per layer, the busiest expert-parallel rank's assignments (the sum over the
  ``E / expert_shards`` experts it holds, contiguous) over the ranks' mean; averaged over layers, since layers run
  one after the other. 1.0 is balanced; with one rank (``expert_shards`` = 1) it is 1.0 by definition. The
  capacity dispatch at this factor gives every rank the busiest rank's work (perfmodel ``--expert-load``)."""
  load = np.asarray(load_LxE, np.float64)
  if load.ndim != 2 or load.shape[1] % expert_shards:
    raise ValueError(f"expert load of shape {load.shape}: want layers x experts with experts divisible by "
                     f"{expert_shards} expert-parallel ranks")
  per_rank = load.reshape(load.shape[0], expert_shards, -1).sum(-1)
  mean = per_rank.mean(-1)
  if np.any(mean <= 0):
    raise ValueError("expert load has a layer with no assignments: pass the counts of a step that ran tokens")
  return float(np.mean(per_rank.max(-1) / mean))


BIAS = "router_bias"  # the parameter name of the balancing bias (MoE layers, E per layer; stacked L x E when scanned)


def update_bias(params, load_LxE, rate: float):
  """DeepSeek-V3's bias update after a step: each layer's bias moves by ``rate`` toward balance, up for the
  experts that got fewer assignments than the layer's mean, down for those that got more
  (``b += rate * sign(mean - load)``). ``load_LxE``: the step's assignments (StepMetrics.expert_load), layers in
  model order (as every leaf of the layer stack holds them). Every other parameter is returned as it is."""
  if not rate or load_LxE is None:
    return params
  load = load_LxE.astype(jnp.float32)
  delta_LxE = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
  biases = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0] if _key(path[-1]) == BIAS]
  # layers in model order: a scanned stack is one L x E leaf; unscanned layers are layers_0, layers_1, ...
  biases.sort(key=lambda path: [(len(k), k) for k in map(_key, path)])
  offset, updates = 0, {}
  for path in biases:
    leaf = _get(params, path)
    n = leaf.size // leaf.shape[-1]  # layers in the leaf: E; L x E scanned; v x L/v x E with virtual stages
    updates[path] = (leaf + delta_LxE[offset:offset + n].reshape(leaf.shape).astype(leaf.dtype))
    offset += n
  if offset != load.shape[0]:
    raise ValueError(f"router bias of {offset} layers for an expert load of {load.shape[0]}")
  return jax.tree_util.tree_map_with_path(lambda path, x: updates.get(path, x), params)


def _key(entry) -> str:
  return str(getattr(entry, "key", getattr(entry, "name", entry)))


def _get(tree, path):
  for entry in path:
    tree = tree[_key(entry)]
  return tree
