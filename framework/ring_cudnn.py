"""Ring attention with cuDNN's fused flash-attention kernel on each block (GPU programs; framework/attention.py
``ring`` dispatches here), as TransformerEngine's context parallelism runs it under NeMo / Megatron-Core.

The ring is framework/attention.py's: zig-zag chunks ``i`` and ``2C-1-i`` per device, K/V passed ``C-1`` hops
around the ``sequence`` axis, and per hop either all queries against the visiting block's first chunk (it comes
from an earlier device) or the second query chunk against all of it (a later device). What differs is the block
kernel and how blocks combine:

* forward: each block is one cuDNN call returning its output and its softmax log-sum-exp (``is_training``), in
  the model's layout (B, T, heads, E; grouped-query heads handled by the kernel). The own block uses the kernel's
  causal mask, which on the zig-zag local order is exactly the positional mask (chunk ``i``'s queries see none of
  chunk ``2C-1-i``, all of chunk ``i``'s earlier keys; chunk ``2C-1-i``'s see all of chunk ``i``); visiting blocks
  need no mask. Blocks merge as (o, lse) pairs: ``lse = logaddexp(lse_a, lse_b)``,
  ``o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)``, in float32.
* backward: flash attention's backward per block, given the *final* output and log-sum-exp (cuDNN's backward
  kernel takes both as inputs), is that block's exact share of dQ, dK, dV; the blocks travel the ring again with
  their key/value gradients, and one last hop brings those home.

cuDNN has no CPU implementation: this path compiles for GPU targets (real or compile-only) and its numerics are
checked on a GPU (tests/framework/test_attention.py, marker ``gpu``). The ring schedule and the (o, lse) merge are
the same functions on every platform: :func:`ring` takes its block kernels as arguments, and the CPU tests run
it with the XLA reference blocks (:func:`xla_blocks`) against dense attention.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from framework import remat


def _perm(size: int) -> list:
  return [(j, (j + 1) % size) for j in range(size)]


def _halves(x, axis: int):
  n = x.shape[axis] // 2
  return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _varying(tree, axis: str):
  def one(x):
    aval = jax.typeof(x)
    have = aval.vma if hasattr(aval, "vma") else aval.manual_axis_type.varying
    return x if axis in have else jax.lax.pcast(x, (axis,), to="varying")
  return jax.tree.map(one, tree)


def merge(o_a, lse_a, o_b, lse_b):
  """Two partial attentions over disjoint keys as one: (B, T, H, E) outputs, (B, H, T) log-sum-exps."""
  lse = jnp.logaddexp(lse_a, lse_b)
  w = lambda l: jnp.exp(l - lse).transpose(0, 2, 1)[..., None]  # noqa: E731 (B, T, H, 1)
  return o_a.astype(jnp.float32) * w(lse_a) + o_b.astype(jnp.float32) * w(lse_b), lse


# ---------------------------------------------------------------------------------------------- block kernels

@functools.lru_cache(maxsize=None)
def cudnn_blocks():
  """(forward, backward) block kernels on cuDNN's fused attention primitives.

  ``forward(q, k, v, causal) -> (o, lse)``; ``backward(q, k, v, o, lse, do, causal) -> (dq, dk, dv)``, with ``o``
  and ``lse`` the final ones of the whole ring."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415 (GPU programs only)

  def mask(causal):
    return fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK

  def common(q, causal):
    return dict(scale=1.0 / math.sqrt(q.shape[-1]), seed=42, dropout_rate=0.0, variadic_args=(False, False),
                mask_type=mask(causal), layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None)

  def unused(q):
    return (jnp.zeros(0, q.dtype),) * 7  # bias, q/kv seqlen, q/kv offsets, page tables: not used

  def forward(q, k, v, causal):
    o, lse = fa._dot_product_attention_fwd_p_wrapper.bind(q, k, v, *unused(q), is_training=True,  # noqa: SLF001
                                                          **common(q, causal))
    return o, lse

  def backward(q, k, v, o, lse, do, causal):
    dq, dk, dv = fa._dot_product_attention_bwd_p_wrapper.bind(  # noqa: SLF001
        q, k, v, *unused(q), lse, o.astype(q.dtype), do, **common(q, causal))
    return dq, dk, dv

  return forward, backward


@functools.lru_cache(maxsize=None)
def xla_blocks():
  """The same (forward, backward) interface in plain XLA (materialised block scores): the reference the CPU tests
  run the ring with."""
  def scores(q, k, causal):
    B, T, H, E = q.shape
    K = k.shape[2]
    s = jnp.einsum("btkge,bske->bkgts", q.reshape(B, T, K, H // K, E), k,
                   preferred_element_type=jnp.float32) / math.sqrt(E)
    if causal:
      s = jnp.where(jnp.tril(jnp.ones((T, k.shape[1]), bool)), s, -jnp.inf)
    return s.reshape(B, H, T, -1)

  def forward(q, k, v, causal):
    s = scores(q, k, causal)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    return _pv(p, v, q.dtype), lse

  def backward(q, k, v, o, lse, do, causal):
    B, T, H, E = q.shape
    K = k.shape[2]
    p = jnp.exp(scores(q, k, causal) - lse[..., None])  # B,H,T,S
    do_h = do.astype(jnp.float32).transpose(0, 2, 1, 3)  # B,H,T,E
    delta = jnp.sum(do_h * o.astype(jnp.float32).transpose(0, 2, 1, 3), axis=-1)
    v_h = jnp.repeat(v.astype(jnp.float32), H // K, axis=2).transpose(0, 2, 1, 3)  # B,H,S,E
    k_h = jnp.repeat(k.astype(jnp.float32), H // K, axis=2).transpose(0, 2, 1, 3)
    ds = p * (jnp.einsum("bhte,bhse->bhts", do_h, v_h) - delta[..., None]) / math.sqrt(E)
    dq = jnp.einsum("bhts,bhse->bthe", ds, k_h)
    group = lambda x: x.reshape(B, -1, K, H // K, E).sum(3)  # noqa: E731 heads of a group -> their kv head
    dk = group(jnp.einsum("bhts,bhte->bshe", ds, q.astype(jnp.float32).transpose(0, 2, 1, 3)))
    dv = group(jnp.einsum("bhts,bhte->bshe", p, do_h))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

  return forward, backward


def _pv(p_BxHxTxS, v_BxSxKxE, dtype):
  B, H, T, S = p_BxHxTxS.shape
  K = v_BxSxKxE.shape[2]
  p = p_BxHxTxS.reshape(B, K, H // K, T, S)
  return jnp.einsum("bkgts,bske->btkge", p, v_BxSxKxE.astype(jnp.float32)).reshape(B, T, H, -1).astype(dtype)


# ---------------------------------------------------------------------------------------------- the ring

def ring(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, *, axis: str, size: int, blocks=None):
  """Ring attention over the manual axis ``axis`` on zig-zag local sequences (inside ``shard_map``).
  ``blocks``: the (forward, backward) block kernels, default cuDNN's."""
  return _ring(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, axis, size, blocks or cudnn_blocks())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q, k, v, axis, size, blocks):
  return _forward(q, k, v, axis, size, blocks)[0]


def _forward(q, k, v, axis, size, blocks):
  fwd, _ = blocks
  me = jax.lax.axis_index(axis)
  o, lse = fwd(q, k, v, True)  # own block

  def step(carry, r):
    o, lse, k, v = carry
    k, v = jax.lax.ppermute((k, v), axis, _perm(size))
    src = (me - r) % size

    def earlier(o, lse):  # every query against the visiting block's first chunk
      ob, lb = fwd(q, _halves(k, 1)[0], _halves(v, 1)[0], False)
      return merge(o, lse, ob, lb)

    def later(o, lse):  # the second query chunk against all of it
      ob, lb = fwd(_halves(q, 1)[1], k, v, False)
      o2, l2 = merge(_halves(o, 1)[1], _halves(lse, 2)[1], ob, lb)
      return jnp.concatenate([_halves(o, 1)[0], o2], 1), jnp.concatenate([_halves(lse, 2)[0], l2], 2)
    return (*jax.lax.cond(src < me, earlier, later, o, lse), k, v), None

  init = _varying((o.astype(jnp.float32), lse, k, v), axis)
  (o, lse, _, _), _ = jax.lax.scan(step, init, jnp.arange(1, size))
  return o.astype(q.dtype), lse


def _ring_fwd(q, k, v, axis, size, blocks):
  o, lse = remat.kernel_residuals(*_forward(q, k, v, axis, size, blocks))
  return o, (q, k, v, o, lse)


def _ring_bwd(axis, size, blocks, res, do):
  _, bwd = blocks
  q, k, v, o, lse = res
  me = jax.lax.axis_index(axis)
  do = do.astype(q.dtype)
  f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731
  dq, dk, dv = f32(*bwd(q, k, v, o, lse, do, True))  # own block

  def step(carry, r):
    dq, k, v, dk, dv = carry
    k, v, dk, dv = jax.lax.ppermute((k, v, dk, dv), axis, _perm(size))
    src = (me - r) % size

    def earlier(dq, dk, dv):
      gq, gk, gv = f32(*bwd(q, _halves(k, 1)[0], _halves(v, 1)[0], o, lse, do, False))
      pad = lambda g: jnp.concatenate([g, jnp.zeros_like(g)], axis=1)  # noqa: E731
      return dq + gq, dk + pad(gk), dv + pad(gv)

    def later(dq, dk, dv):
      h = lambda x, ax=1: _halves(x, ax)[1]  # noqa: E731
      gq, gk, gv = f32(*bwd(h(q), k, v, h(o), h(lse, 2), h(do), False))
      return dq + jnp.concatenate([jnp.zeros_like(gq), gq], axis=1), dk + gk, dv + gv
    dq, dk, dv = jax.lax.cond(src < me, earlier, later, dq, dk, dv)
    return (dq, k, v, dk, dv), None

  (dq, _, _, dk, dv), _ = jax.lax.scan(step, _varying((dq, k, v, dk, dv), axis), jnp.arange(1, size))
  dk, dv = jax.lax.ppermute((dk, dv), axis, _perm(size))  # the last hop: each block's gradient comes home
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)
