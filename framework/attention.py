"""Causal self-attention kernels (``model.attention``); all compute the same function.

Inputs are the rotated queries ``q_BxTxHxE``, keys and values ``k/v_BxSxKxE`` (grouped-query: H = K x G)
and the global positions of queries and keys; query t attends to key s iff ``kpos[s] <= qpos[t]``. Masking
by positions, not by index, is what makes sequence parallelism work: a device's queries are a slice of the
sequence while its keys (all-gathered) are the whole of it.

* :func:`dense`: T x S f32 scores and a masked softmax (the reference; the KV-cache decode path).
* :func:`blockwise`: online softmax over blocks of keys (a ``lax.scan``), with a ``custom_vjp`` whose
  backward recomputes each block's probabilities from the saved log-sum-exp, as flash attention does; the
  residuals are q, k, v, the output and one f32 per query and head, so neither pass holds more than
  T x block scores. It executes every block, masked ones included: the FLOPs are those of dense.
* :func:`dot_product`: ``jax.nn.dot_product_attention`` (``implementation`` None lets XLA choose,
  ``'cudnn'`` asks for the cuDNN fused kernel).
* :func:`ring`: context parallelism without gathering K/V: key/value blocks travel around the ``sequence`` ring,
  each folded into an online softmax, with the zig-zag layout that balances causal work (Llama 3, NeMo); in GPU
  programs each block is a cuDNN flash-attention call (framework/ring_cudnn.py).
* :func:`splash`: the Pallas TPU splash-attention kernel, per (batch, kv head) as multi-query attention
  over the G query heads of the group; under a mesh it runs in a ``shard_map`` over the batch and head
  axes, because GSPMD cannot partition a Mosaic custom call and would gather its operands.

Which kernels can run is a property of the target, not of the host: :func:`platform` reads the device
platform of the mesh the program is being built for (``jax.set_mesh`` / ``use_abstract_mesh``, also inside
``shard_map``), so a TPU program lowers from a CPU host.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from framework import remat
from framework import ring_cudnn

# Runs the splash kernel in Pallas' interpreter (any backend) instead of as a Mosaic TPU kernel. Only for
# checking its numerics off-TPU; never set for real programs.
SPLASH_INTERPRET = False
# (forward, backward) block kernels that replace cuDNN's in the GPU ring (framework/ring_cudnn.py) and make every
# platform run that ring: only for checking its schedule and merge off-GPU (``ring_cudnn.xla_blocks()``).
RING_BLOCKS = None


def platform() -> str:
  """Device platform ('cpu', 'gpu', 'tpu', ...) of the program being traced: the context mesh's, else the
  default backend's."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None:
    return device.platform
  return jax.default_backend()


def dense(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, valid_BxS=None):
  """Materialised scores: O(T x S) memory per head. ``valid_BxS`` masks unwritten KV-cache slots."""
  B, T, Hl, E = q_BxTxHxE.shape
  Kl = k_BxSxKxE.shape[2]
  q_BxTxKxGxE = q_BxTxHxE.reshape(B, T, Kl, Hl // Kl, E)
  s_BxKxGxTxS = jnp.einsum("btkge,bske->bkgts", q_BxTxKxGxE, k_BxSxKxE).astype(jnp.float32)
  s_BxKxGxTxS = checkpoint_name(s_BxKxGxTxS, remat.ATTN_SCORES) / math.sqrt(E)
  mask_BxTxS = kpos_BxS[:, None, :] <= qpos_BxT[:, :, None]
  if valid_BxS is not None:
    mask_BxTxS = mask_BxTxS & valid_BxS[:, None, :]
  s_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], s_BxKxGxTxS, jnp.finfo(jnp.float32).min)
  p_BxKxGxTxS = jax.nn.softmax(s_BxKxGxTxS, axis=-1).astype(v_BxSxKxE.dtype)
  o_BxTxKxGxE = jnp.einsum("bkgts,bske->btkge", p_BxKxGxTxS, v_BxSxKxE)
  return checkpoint_name(o_BxTxKxGxE.reshape(B, T, Hl, E), remat.ATTN_OUT)


# ---------------------------------------------------------------------------------------------- blockwise

def blockwise(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, block: int):
  """Online-softmax attention over key blocks of ``min(block, S)``; O(T x block) scores in both passes.

  Keys are padded to a whole number of blocks with positions no query reaches, so any S works."""
  B, T, H, E = q_BxTxHxE.shape
  S, K = k_BxSxKxE.shape[1], k_BxSxKxE.shape[2]
  blk = min(block, S)
  pad = -S % blk
  if pad:
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    k_BxSxKxE, v_BxSxKxE = jnp.pad(k_BxSxKxE, widths), jnp.pad(v_BxSxKxE, widths)
    kpos_BxS = jnp.pad(kpos_BxS, ((0, 0), (0, pad)), constant_values=jnp.iinfo(kpos_BxS.dtype).max)
  # Head-group-major layout once, outside the loop: every block's matmuls then read q contiguously.
  q_BxKxGxTxE = q_BxTxHxE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)
  o_BxKxGxTxE = _flash(q_BxKxGxTxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, blk)
  return o_BxKxGxTxE.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E)


def _blocks(k_BxSxKxE, v_BxSxKxE, kpos_BxS, blk: int):
  """Keys, values and positions as a leading axis of S / blk blocks (the scan axis)."""
  B, S, K, E = k_BxSxKxE.shape
  n = S // blk
  kb = k_BxSxKxE.reshape(B, n, blk, K, E).transpose(1, 0, 2, 3, 4)
  vb = v_BxSxKxE.reshape(B, n, blk, K, E).transpose(1, 0, 2, 3, 4)
  pb = kpos_BxS.reshape(B, n, blk).transpose(1, 0, 2)
  return kb, vb, pb


def _scores(q_BxKxGxTxE, k_BxCxKxE, qpos_BxT, kpos_BxC):
  """One block's scaled scores (f32) and its causal mask."""
  scale = 1.0 / math.sqrt(q_BxKxGxTxE.shape[-1])
  s = jnp.einsum("bkgte,bcke->bkgtc", q_BxKxGxTxE, k_BxCxKxE, preferred_element_type=jnp.float32) * scale
  mask_Bx1x1xTxC = (kpos_BxC[:, None, :] <= qpos_BxT[:, :, None])[:, None, None]
  return s, mask_Bx1x1xTxC


def _init_stats(q):
  """Online-softmax state before any key: running max (-inf), sum and accumulator (f32)."""
  stats = jnp.zeros_like(q[..., 0], dtype=jnp.float32)  # zeros_like keeps shard_map's varying-axes type
  return stats - jnp.inf, stats, jnp.zeros_like(q, dtype=jnp.float32)


def _finish(m, l, acc, dtype):
  """(output, log-sum-exp) from the online-softmax state; rows without a visible key give 0."""
  l = jnp.where(l > 0, l, 1.0)
  o = (acc / l[..., None]).astype(dtype)
  lse = jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(l)
  return o, lse


def _flash_forward(q, k, v, qpos, kpos, blk):
  return _finish(*_flash_stats(q, k, v, qpos, kpos, blk, _init_stats(q)), q.dtype)


def _flash_stats(q, k, v, qpos, kpos, blk, init):
  """The online-softmax state ``init`` (m, l, acc) advanced over the keys ``k``/``v`` in blocks of ``blk``."""
  kb, vb, pb = _blocks(k, v, kpos, blk)

  def step(carry, xs):
    m, l, acc = carry
    kj, vj, pj = xs
    s, mask = _scores(q, kj, qpos, pj)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # Rows with no visible key yet keep m = -inf; shifting them by 0 keeps exp() finite (it is 0).
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - shift[..., None])
    corr = jnp.exp(m - shift)
    l = l * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgtc,bcke->bkgte", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
    return (m_new, l, acc * corr[..., None] + pv), None

  return jax.lax.scan(step, init, (kb, vb, pb))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q_BxKxGxTxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, blk: int):
  return _flash_forward(q_BxKxGxTxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, blk)[0]


def _flash_fwd(q, k, v, qpos, kpos, blk):
  o, lse = remat.kernel_residuals(*_flash_forward(q, k, v, qpos, kpos, blk))
  return o, (q, k, v, qpos, kpos, o, lse)


def _flash_bwd(blk, res, do_BxKxGxTxE):
  q, k, v, qpos, kpos, o, lse = res
  do = do_BxKxGxTxE.astype(q.dtype)
  # d softmax: dS = P * (dP - rowsum(dO * O)), the row sum taken once for all blocks.
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
  dq, dk, dv = _flash_grads(q, k, v, qpos, kpos, do, lse, delta, blk, k.dtype)
  return dq.astype(q.dtype), dk, dv, None, None


def _flash_grads(q, k, v, qpos, kpos, do, lse, delta, blk, kv_dtype):
  """(dq in f32, dk and dv in ``kv_dtype``) of the keys ``k``/``v`` from the final log-sum-exp and
  ``delta`` = rowsum(dO * O)."""
  kb, vb, pb = _blocks(k, v, kpos, blk)
  scale = 1.0 / math.sqrt(q.shape[-1])

  def step(dq, xs):
    kj, vj, pj = xs
    s, mask = _scores(q, kj, qpos, pj)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
    dv = jnp.einsum("bkgtc,bkgte->bcke", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgte,bcke->bkgtc", do, vj, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
    dq = dq + jnp.einsum("bkgtc,bcke->bkgte", ds, kj, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgtc,bkgte->bcke", ds, q, preferred_element_type=jnp.float32)
    return dq, (dk.astype(kv_dtype), dv.astype(kv_dtype))

  dq, (dkb, dvb) = jax.lax.scan(step, jnp.zeros_like(q, dtype=jnp.float32), (kb, vb, pb))
  unblock = lambda x: x.transpose(1, 0, 2, 3, 4).reshape(k.shape)  # noqa: E731
  return dq, unblock(dkb), unblock(dvb)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------- ring

def ring(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, *, axis: str, size: int, block: int):
  """Ring attention over the manual mesh axis ``axis`` (context parallelism; inside ``shard_map`` only).

  Each of the ``size`` devices holds its queries, keys and values in the zig-zag layout
  (parallelism/manual.py ``zigzag``): sequence chunks ``i`` and ``2C-1-i`` of ``T/(2C)`` tokens, with their global
  positions. Key/value blocks travel around the ring (``ppermute``, C-1 hops) and every device folds each visiting
  block into its online-softmax state (the blockwise kernel's, blocks of ``gcd(block, T_local/2)`` keys). The
  layout balances causal work: on the first step a device attends its own block (causal), on every later step
  either all its queries see the visiting block's first chunk only (it comes from an earlier device) or its second
  query chunk sees the whole block (a later device), so every device computes half a block per step, and no
  scores are built for pairs the mask would remove (the first step's masked half excepted).

  Backward (``custom_vjp``, flash-style): residuals are q, k, v, the output and the log-sum-exp; the blocks go
  around the ring again, carrying the key/value gradients every device adds to, and one last hop brings those home.

  In a GPU program with 16-bit compute the same ring runs each block as one cuDNN fused flash-attention call
  (framework/ring_cudnn.py), as TransformerEngine's context parallelism does.
  """
  if RING_BLOCKS is not None or (platform() == "gpu" and q_BxTxHxE.dtype in (jnp.bfloat16, jnp.float16)):
    return ring_cudnn.ring(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, axis=axis, size=size, blocks=RING_BLOCKS)
  B, T, H, E = q_BxTxHxE.shape
  K = k_BxSxKxE.shape[2]
  blk = math.gcd(block, T // 2)
  q_BxKxGxTxE = q_BxTxHxE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)
  o_BxKxGxTxE = _ring(q_BxKxGxTxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, axis, size, blk)
  return o_BxKxGxTxE.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E)


def _ring_perm(size: int) -> list:
  return [(j, (j + 1) % size) for j in range(size)]


def _varying(tree, axis: str):
  """``tree`` typed as varying over ``axis`` (shard_map's vma): what ``ppermute`` returns, so the ring's scan
  carries keep one type even where a value's type does not say so yet (flax traces its scan body abstractly)."""
  def one(x):
    aval = jax.typeof(x)
    have = aval.vma if hasattr(aval, "vma") else aval.manual_axis_type.varying
    return x if axis in have else jax.lax.pcast(x, (axis,), to="varying")
  return jax.tree.map(one, tree)


def _halves(x, axis: int):
  n = x.shape[axis] // 2
  return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _ring_forward(q, k, v, qpos, kpos, axis, size, blk):
  me = jax.lax.axis_index(axis)
  stats = _flash_stats(q, k, v, qpos, kpos, blk, _init_stats(q))  # own block: causal by positions

  def step(carry, r):
    stats, k, v, kpos = carry
    k, v, kpos = jax.lax.ppermute((k, v, kpos), axis, _ring_perm(size))
    src = (me - r) % size

    def earlier(stats):  # block of an earlier device: every query sees its first chunk, none its second
      return _flash_stats(q, _halves(k, 1)[0], _halves(v, 1)[0], qpos, _halves(kpos, 1)[0], blk, stats)

    def later(stats):  # block of a later device: only the second query chunk sees it, all of it
      m, l, acc = stats
      late = _flash_stats(_halves(q, 3)[1], k, v, _halves(qpos, 1)[1], kpos, blk,
                          (_halves(m, 3)[1], _halves(l, 3)[1], _halves(acc, 3)[1]))
      return tuple(jnp.concatenate([_halves(a, 3)[0], b], axis=3) for a, b in zip(stats, late))
    return (jax.lax.cond(src < me, earlier, later, stats), k, v, kpos), None

  (stats, _, _, _), _ = jax.lax.scan(step, _varying((stats, k, v, kpos), axis), jnp.arange(1, size))
  return _finish(*stats, q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q_BxKxGxTxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, axis: str, size: int, blk: int):
  return _ring_forward(q_BxKxGxTxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, axis, size, blk)[0]


def _ring_fwd(q, k, v, qpos, kpos, axis, size, blk):
  o, lse = remat.kernel_residuals(*_ring_forward(q, k, v, qpos, kpos, axis, size, blk))
  return o, (q, k, v, qpos, kpos, o, lse)


def _ring_bwd(axis, size, blk, res, do_BxKxGxTxE):
  q, k, v, qpos, kpos, o, lse = res
  me = jax.lax.axis_index(axis)
  do = do_BxKxGxTxE.astype(q.dtype)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
  grads = functools.partial(_flash_grads, blk=blk, kv_dtype=jnp.float32)
  dq, dk, dv = grads(q, k, v, qpos, kpos, do, lse, delta)  # own block

  def step(carry, r):
    dq, k, v, kpos, dk, dv = carry
    k, v, kpos, dk, dv = jax.lax.ppermute((k, v, kpos, dk, dv), axis, _ring_perm(size))
    src = (me - r) % size

    def earlier(dq, dk, dv):
      (k0, _), (v0, _), (p0, _) = _halves(k, 1), _halves(v, 1), _halves(kpos, 1)
      gq, gk, gv = grads(q, k0, v0, qpos, p0, do, lse, delta)
      pad = lambda g: jnp.concatenate([g, jnp.zeros_like(g)], axis=1)  # noqa: E731
      return dq + gq, dk + pad(gk), dv + pad(gv)

    def later(dq, dk, dv):
      gq, gk, gv = grads(_halves(q, 3)[1], k, v, _halves(qpos, 1)[1], kpos, _halves(do, 3)[1],
                         _halves(lse, 3)[1], _halves(delta, 3)[1])
      return dq + jnp.concatenate([jnp.zeros_like(gq), gq], axis=3), dk + gk, dv + gv
    dq, dk, dv = jax.lax.cond(src < me, earlier, later, dq, dk, dv)
    return (dq, k, v, kpos, dk, dv), None

  (dq, _, _, _, dk, dv), _ = jax.lax.scan(step, _varying((dq, k, v, kpos, dk, dv), axis), jnp.arange(1, size))
  dk, dv = jax.lax.ppermute((dk, dv), axis, _ring_perm(size))  # the last hop: each block's gradient comes home
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------------------------------------- library kernels

def dot_product(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, *, aligned: bool, implementation=None):
  """``jax.nn.dot_product_attention``. ``aligned``: query t is at key index t (no sequence parallelism), so
  the kernel's own causal mask applies; otherwise the mask is built from the positions."""
  if implementation == "cudnn" and platform() != "gpu":
    raise ValueError(f"model.attention='cudnn' needs a GPU, this program is for {platform()!r}: use "
                     f"model.attention='dot_product' or 'blockwise'")
  if aligned:
    return jax.nn.dot_product_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, is_causal=True,
                                        implementation=implementation)
  mask_Bx1xTxS = (kpos_BxS[:, None, :] <= qpos_BxT[:, :, None])[:, None]
  return jax.nn.dot_product_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask=mask_Bx1xTxS,
                                      implementation=implementation)


def _splash_kernel(t: int, s: int, groups: int, block: int, interpret: bool):
  """Multi-query splash kernel for one (batch, kv head): q G x T x E, k/v S x E. Built per trace (not
  cached): it holds the mask's block tables as arrays of the trace that built it."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk  # noqa: PLC0415 (TPU-only kernel module)
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm  # noqa: PLC0415 (TPU-only kernel module)
  mask = sm.MultiHeadMask([sm.CausalMask((t, s)) for _ in range(groups)])
  bq, bkv = min(block, t), min(block, s)
  sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                        block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
  return sk.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def _splash_local(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, block: int):
  B, T, H, E = q_BxTxHxE.shape
  S, K = k_BxSxKxE.shape[1], k_BxSxKxE.shape[2]
  kernel = _splash_kernel(T, S, H // K, block, SPLASH_INTERPRET)
  # The kernel does not scale the scores; scaling q (T x E) is cheaper than the scores (T x S).
  q_BxKxGxTxE = (q_BxTxHxE * (1.0 / math.sqrt(E))).astype(q_BxTxHxE.dtype)
  q_BxKxGxTxE = q_BxKxGxTxE.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)
  k_BxKxSxE, v_BxKxSxE = k_BxSxKxE.transpose(0, 2, 1, 3), v_BxSxKxE.transpose(0, 2, 1, 3)
  o_BxKxGxTxE = jax.vmap(jax.vmap(kernel))(q_BxKxGxTxE, k_BxKxSxE, v_BxKxSxE)
  return o_BxKxGxTxE.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E).astype(q_BxTxHxE.dtype)


def splash(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, *, block: int):
  """Splash attention (causal, query i at key i), in auto (GSPMD) mode only.

  Inside a ``check_vma=True`` shard_map (the shard_map form, the pipelined jit form) jax 0.10 refuses the
  kernel: its ``pallas_call`` declares outputs without varying-axes types."""
  if platform() != "tpu" and not SPLASH_INTERPRET:
    raise ValueError(f"model.attention='splash' is a TPU kernel, this program is for {platform()!r}: use "
                     f"model.attention='blockwise' (any backend), or 'cudnn' on GPU")
  mesh = jax.sharding.get_abstract_mesh()
  if getattr(mesh, "manual_axes", ()):
    raise ValueError("model.attention='splash' runs only in mesh.form='jit' without pipeline stages (a "
                     "shard_map cannot type its Pallas kernel): use model.attention='blockwise' there")
  fn = functools.partial(_splash_local, block=block)
  if not mesh.empty:
    # Manual over every mesh axis (XLA refuses to partition a Mosaic call even over size-1 axes); the
    # operands are split over batch and heads as the logical rules shard them, replicated otherwise.
    q_spec = _auto_spec(("batch", None, "q_heads", None), mesh)
    kv_spec = _auto_spec(("batch", None, "kv_heads", None), mesh)
    fn = jax.shard_map(fn, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False)
  return fn(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE)


def _as_tuple(entry):
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _auto_spec(logical, mesh):
  """PartitionSpec of an activation from the logical-axis rules in context, restricted to the mesh's axes
  of size > 1."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  out = []
  for entry in nn.logical_to_mesh_axes(logical):
    kept = tuple(a for a in (_as_tuple(entry) if entry else ()) if a in sizes and sizes[a] > 1)
    out.append(None if not kept else (kept[0] if len(kept) == 1 else kept))
  return jax.sharding.PartitionSpec(*out)


def attend(kind: str, q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, *, block: int, aligned: bool):
  """Dispatches on ``model.attention`` (dense handled by the caller, which keeps its exact program)."""
  if kind in ("blockwise", "ring"):  # ring outside a manual sequence axis: the same online softmax on one device
    return blockwise(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, block)
  if kind in ("dot_product", "cudnn"):
    return dot_product(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS, aligned=aligned,
                       implementation="cudnn" if kind == "cudnn" else None)
  if kind == "splash":
    if not aligned:
      raise ValueError("model.attention='splash' needs queries and keys to start together (no sequence "
                       "parallelism): use model.attention='blockwise'")
    return splash(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, block=block)
  if kind == "dense":
    return dense(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, qpos_BxT, kpos_BxS)
  raise ValueError(f"model.attention={kind!r} is not a kernel; see framework/config.py ATTENTION_KINDS")
