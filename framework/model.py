"""Llama-family decoder in Flax Linen.

Why Linen (not NNX): ``nn.scan`` + ``nn.remat`` give a scanned, rematerialised layer stack whose
parameters carry logical axis names (``nn.with_logical_partitioning``), so sharding is pure data
(``parallelism/rules.py``), and ``Module.apply`` is a pure function of a params pytree, which is
exactly what the pure train step, the shard_map step, the pipeline, HF/GGUF conversion and
``jax.eval_shape`` of 70B-class models all want.

The same module runs in two modes, chosen by :class:`ParallelCtx`:
* auto (``ctx.manual=False``): full-size parameters; under ``jax.jit`` XLA/GSPMD partitions it
  following the logical-axis rules.
* manual (``ctx.manual=True``, inside ``jax.shard_map``): every parameter is declared at its
  *local* (per-device) shape; dimensions sharded over FSDP-style axes are all-gathered right
  before use (their transpose is the reduce-scatter of the gradients), tensor-parallel dimensions
  stay local and the row-parallel matmuls end in an explicit ``psum`` (Megatron). Sequence
  (context) parallelism all-gathers K/V along the sequence, or passes them around it (``attention='ring'``).
  With ``ctx.tensor_sequence_parallel`` (Megatron sequence parallelism) the residual stream between the
  matmuls holds this tensor rank's ``T/tensor`` chunk: norms run on the chunk, the normed input of the
  column-parallel projections is all-gathered along T, the row-parallel epilogue is a ``psum_scatter`` onto
  the chunk instead of the ``psum``.

Shapes are in names: B batch, T query length, S key length, D d_model, H query heads,
K kv heads, G = H // K, E head_dim, F d_ff, V vocab, L layers.

Parameter tree (``L`` leading axis from the layer scan)::

  embed/embedding                   V x D
  layers/attn_norm/scale            L x D
  layers/attn/{wq,wk,wv}            L x D x {H,K,K} x E
  layers/attn/wo                    L x H x E x D
  layers/attn/{bq,bk,bv}            L x {H,K,K} x E   (only with qkv_bias, Qwen2)
  layers/mlp_norm/scale             L x D
  layers/mlp/{w_gate,w_up}          L x D x F   (w_gate only in the gated 'swiglu' MLP)
  layers/mlp/w_down                 L x F x D
  final_norm/scale                  D
  lm_head/kernel                    D x V   (absent with tied embeddings)

The layers (parallel context, base module, RMSNorm, MLP, mixture of experts) live in framework/layers.py, the
attention kernel (``model.attention``) in framework/attention.py, the remat policies
(``model.remat``) in framework/remat.py.

RoPE (framework/rope.py, with ``model.rope_scaling``) uses the Hugging Face "rotate-half" layout, so HF checkpoints
load without permutation; the GGUF name map applies llama.cpp's interleaved permutation in one place.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from framework import attention
from framework import fp8
from framework import remat as remat_lib
from framework import rope as rope_lib
from framework.config import ModelConfig
from framework.layers import MLP, PARAM_AXES, MoE, ParallelCtx, RMSNorm, _Base, _dtype  # noqa: F401 (re-exported)
from framework.rope import rope

# the projections whose fp8 weights a train step quantizes once (fp8_cache); the routed experts' are quantized
# per matmul (their dropless path multiplies with ragged_dot, not an fp8 dot)
FP8_CACHED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def fp8_cache(cfg, params):
  """The model variables beside ``params`` for one train step: under ``matmul_precision='fp8'`` the projection
  weights quantized once (framework/fp8.py weight_cache), to be read by every micro-batch; else none."""
  if cfg.matmul_precision != "fp8":
    return {}
  return {fp8.CACHE: fp8.weight_cache(params, {n: len(PARAM_AXES[n]) for n in FP8_CACHED}, _dtype(cfg.dtype))}


# parameters the optimizer does not weight-decay (framework/optim.py decayed): norms' scales, biases, the router's
# balancing bias (moved by framework/moe.py update_bias, not by gradients)
NOT_DECAYED = ("scale", "bq", "bk", "bv", "router_bias")


class Attention(_Base):
  @nn.compact
  def __call__(self, x_BxTxD, pos_BxT, kv_cache=None, cache_index=None):
    c = self.cfg
    D, H, K, E = c.d_model, c.n_heads, c.n_kv_heads, c.hd
    wq = self.weight("wq", (D, H, E))
    wk = self.weight("wk", (D, K, E))
    wv = self.weight("wv", (D, K, E))
    wo = self.weight("wo", (H, E, D))
    factors = rope_lib.freq_factors(c)
    q_BxTxHxE = rope(self.tag(self.biased("btd,dhe->bthe", x_BxTxD, wq, "bq", (H, E)), remat_lib.QUERY), pos_BxT,
                     c.rope_theta, factors)
    k_BxTxKxE = rope(self.tag(self.biased("btd,dke->btke", x_BxTxD, wk, "bk", (K, E)), remat_lib.KEY), pos_BxT,
                     c.rope_theta, factors)
    v_BxTxKxE = self.tag(self.biased("btd,dke->btke", x_BxTxD, wv, "bv", (K, E)), remat_lib.VALUE)
    kpos_BxS = pos_BxT
    new_cache = valid_BxS = None
    sequence_parallel = self.ctx.manual and self.ctx.sequence_axis and self.ctx.size((self.ctx.sequence_axis,)) > 1
    if kv_cache is not None:
      # Decode: write this chunk at cache_index, attend over the whole (masked) cache.
      k_cache, v_cache = kv_cache
      k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k_BxTxKxE.astype(k_cache.dtype), cache_index, 1)
      v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v_BxTxKxE.astype(v_cache.dtype), cache_index, 1)
      new_cache = (k_cache, v_cache)
      k_BxTxKxE, v_BxTxKxE = k_cache.astype(q_BxTxHxE.dtype), v_cache.astype(q_BxTxHxE.dtype)
      kpos_BxS = jnp.broadcast_to(jnp.arange(k_cache.shape[1]), k_cache.shape[:2])
      # Slots past the written prefix hold zeros; mask them by position.
      valid_BxS = kpos_BxS < cache_index + x_BxTxD.shape[1]
    elif sequence_parallel and c.attention != "ring":  # ring attention passes K/V around instead
      ax = self.ctx.sequence_axis
      k_BxTxKxE = jax.lax.all_gather(k_BxTxKxE, ax, axis=1, tiled=True)
      v_BxTxKxE = jax.lax.all_gather(v_BxTxKxE, ax, axis=1, tiled=True)
      kpos_BxS = jax.lax.all_gather(pos_BxT, ax, axis=1, tiled=True)
    # Decode attends a few new queries to the cache (small T x S); parameters do not depend on the kernel,
    # so init traces dense too (its dummy 1 x 8 batch need not fit a kernel's block constraints).
    if c.attention == "dense" or kv_cache is not None or self.is_initializing():
      o_BxTxHxE = attention.dense(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, pos_BxT, kpos_BxS, valid_BxS)
    elif sequence_parallel and c.attention == "ring":
      o_BxTxHxE = attention.ring(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, pos_BxT, kpos_BxS, axis=self.ctx.sequence_axis,
                                 size=self.ctx.size((self.ctx.sequence_axis,)), block=c.attention_block)
    else:
      o_BxTxHxE = attention.attend(c.attention, q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, pos_BxT, kpos_BxS,
                                   block=c.attention_block, aligned=not sequence_parallel)
    out_BxTxD = self.tp_reduce(self.project("bthe,hed->btd", o_BxTxHxE, wo))
    return self.tag(out_BxTxD, remat_lib.OUT), new_cache


  def biased(self, subscripts: str, x_BxTxD, w, bias: str, shape: tuple):
    """A q/k/v projection, plus its bias ``bias`` (global ``shape`` heads x E, zero-initialised) with ``qkv_bias``."""
    y = self.project(subscripts, x_BxTxD, w)
    if not self.cfg.qkv_bias:
      return y
    return y + self.weight(bias, shape, nn.initializers.zeros)[None, None]


class Block(_Base):
  """One pre-norm decoder layer (``cfg.block``: sequential or parallel); signature fits ``nn.scan``:
  (carry, *scanned) -> (carry, out). Under sequence parallelism ``x_BxTxD`` is this tensor rank's chunk of the
  sequence and ``pos_BxT`` the whole (local) sequence's positions: the norms run on the chunk, attention and MLP
  on the gathered sequence."""

  @nn.compact
  def __call__(self, x_BxTxD, pos_BxT, kv_cache, cache_index):
    chunk_BxTxD = RMSNorm(self.cfg, self.ctx, name="attn_norm")(x_BxTxD)
    h, new_cache = Attention(self.cfg, self.ctx, name="attn")(self.tp_gather(chunk_BxTxD), pos_BxT, kv_cache,
                                                              cache_index)
    # the MoE layer gathers its own input (its router reads it as replicated over the tensor ranks)
    ffn = MoE(self.cfg, self.ctx, name="moe") if self.cfg.moe else MLP(self.cfg, self.ctx, name="mlp")
    gather = (lambda x: x) if self.cfg.moe else self.tp_gather  # noqa: E731
    if self.cfg.block == "parallel":  # both branches read the one normed input; their outputs add
      x_BxTxD = x_BxTxD + h + ffn(gather(chunk_BxTxD))
      return self.constrain(x_BxTxD, ("batch", "seq", "act_embed")), new_cache
    x_BxTxD = self.constrain(x_BxTxD + h, ("batch", "seq", "act_embed"))
    x_BxTxD = x_BxTxD + ffn(gather(RMSNorm(self.cfg, self.ctx, name="mlp_norm")(x_BxTxD)))
    x_BxTxD = self.constrain(x_BxTxD, ("batch", "seq", "act_embed"))
    return x_BxTxD, new_cache


class Transformer(_Base):
  """Decoder-only LM. ``__call__`` = ``head(blocks(embed(tokens)))``; the pieces are separate
  methods so a pipeline stage can run ``blocks`` alone on its slice of the layer stack."""

  def setup(self):
    c = self.cfg
    block = Block
    if c.remat != "none":
      remat_lib.check_host_offload(c.remat, attention.platform())
      block = nn.remat(Block, policy=remat_lib.policy(c.remat), prevent_cse=not c.scan_layers)
    if c.scan_layers:
      def scan(cls, length, axis):
        return nn.scan(cls, variable_axes={"params": 0, "moe": 0, fp8.CACHE: 0}, split_rngs={"params": True},
                       in_axes=(nn.broadcast, 0, nn.broadcast), length=length,
                       metadata_params={nn.PARTITION_NAME: axis})
      stack = scan(block, self.n_local_layers, "layers")
      if self.ctx.layer_repeats > 1:
        stack = scan(stack, self.ctx.layer_repeats, "layer_repeats")
      self.layers = stack(c, self.ctx, name="layers")
    else:
      self.layer_list = [block(c, self.ctx, name=f"layers_{i}") for i in range(self.n_local_layers)]
    self.final_norm = RMSNorm(c, self.ctx, name="final_norm")
    self.embedding = _Embed(c, self.ctx, name="embed")
    if not c.tie_embeddings:
      self.lm_head = _Head(c, self.ctx, name="lm_head")

  @property
  def vocab_sharded_logits(self) -> bool:
    """True when head() returns only this device's vocab shard (manual TP). A tied head uses this rank's rows of the
    shared table (Megatron's vocab-parallel output layer)."""
    n = self.ctx.size(self.ctx.mesh_axes("vocab")) if self.ctx.manual else 1
    return n > 1

  @property
  def n_local_layers(self):
    """Layers of one scanned chunk on this device: n_layers / (pipeline stages x layer repeats)."""
    pipe = dict(self.ctx.axis_sizes).get("pipeline", 1) if self.ctx.manual else 1
    return self.cfg.n_layers // (pipe * self.ctx.layer_repeats)

  def embed(self, tokens_BxT):
    """Token embeddings. The table's vocab dim ('embed_vocab') is sharded over the tensor axis (Megatron's
    VocabParallelEmbedding): in the jit form GSPMD partitions the gather; in manual TP each rank looks up the
    tokens whose rows it holds (zeros for the others) and the partial embeddings are summed over the tensor axis
    (``tp_reduce``: a psum, or under sequence parallelism a reduce-scatter leaving this rank's sequence chunk)."""
    w_VxD = self.embedding()
    if not (self.ctx.manual and self.ctx.size(self.ctx.mesh_axes("embed_vocab")) > 1):
      x_BxTxD = jnp.take(w_VxD, tokens_BxT, axis=0)
      return self.constrain(x_BxTxD, ("batch", "seq", "act_embed"))
    n_local = w_VxD.shape[0]
    ids_BxT = tokens_BxT - jax.lax.axis_index(self.ctx.mesh_axes("embed_vocab")) * n_local
    mine_BxT = (ids_BxT >= 0) & (ids_BxT < n_local)
    x_BxTxD = jnp.take(w_VxD, jnp.clip(ids_BxT, 0, n_local - 1), axis=0)
    return self.tp_reduce(jnp.where(mine_BxT[..., None], x_BxTxD, jnp.zeros((), x_BxTxD.dtype)))

  def blocks(self, x_BxTxD, pos_BxT, kv_cache=None, cache_index=None):
    if self.cfg.scan_layers:
      r = self.ctx.layer_repeats
      if r > 1 and kv_cache is not None:  # the cache keeps its L x ... layout; the stack is r x L/r
        split = lambda a: a.reshape((r, a.shape[0] // r) + a.shape[1:])  # noqa: E731
        x_BxTxD, new = self.layers(x_BxTxD, pos_BxT, jax.tree.map(split, kv_cache), cache_index)
        return x_BxTxD, jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), new)
      return self.layers(x_BxTxD, pos_BxT, kv_cache, cache_index)
    new = []
    for i, layer in enumerate(self.layer_list):
      kv = None if kv_cache is None else jax.tree.map(lambda a: a[i], kv_cache)
      x_BxTxD, c = layer(x_BxTxD, pos_BxT, kv, cache_index)
      new.append(c)
    new_cache = None if kv_cache is None else jax.tree.map(lambda *a: jnp.stack(a), *new)
    return x_BxTxD, new_cache

  def head(self, x_BxTxD):
    """Final norm + LM head -> logits (local vocab shard in manual TP mode), float32."""
    c = self.cfg
    x_BxTxD = self.final_norm(x_BxTxD)
    if self.ctx.tp_sequence_sharded:
      # The vocab-parallel head is a column-parallel matmul (gradient: reduce-scatter); a replicated head computes
      # the same logits on every tensor rank, so its input is gathered as replicated (gradient: this rank's slice).
      x_BxTxD = jax.lax.all_gather(x_BxTxD, self.ctx.tensor_axis, axis=1, tiled=True,
                                   to="varying" if self.vocab_sharded_logits else "invarying")
    if c.tie_embeddings:
      w_VxD = self.embedding()  # under manual TP this rank's vocab rows: a vocab-parallel output layer
      logits_BxTxV = jnp.einsum("btd,vd->btv", x_BxTxD, w_VxD)
    else:
      logits_BxTxV = self.lm_head(x_BxTxD)
    return self.constrain(logits_BxTxV.astype(jnp.float32), ("batch", "seq", "act_vocab"))

  def __call__(self, tokens_BxT, pos_BxT=None, kv_cache=None, cache_index=None):
    if pos_BxT is None:
      pos_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    x_BxTxD, new_cache = self.blocks(self.embed(tokens_BxT), pos_BxT, kv_cache, cache_index)
    logits = self.head(x_BxTxD)
    return (logits, new_cache) if kv_cache is not None else logits


class _Embed(_Base):
  @nn.compact
  def __call__(self):
    c = self.cfg
    init = nn.initializers.normal(1.0 if c.tie_embeddings else c.init_std)
    logical = PARAM_AXES["embedding"]
    shape = (c.vocab_size, c.d_model)
    if self.ctx.manual:
      w = self.param("embedding", init, self.ctx.local_shape(shape, logical), _dtype(c.param_dtype))
      w = self.ctx.gather(w, logical)
    else:
      w = self.param("embedding", nn.with_logical_partitioning(init, logical), shape, _dtype(c.param_dtype))
    return w.astype(_dtype(c.dtype))


class _Head(_Base):
  @nn.compact
  def __call__(self, x_BxTxD):
    w_DxV = self.weight("kernel", (self.cfg.d_model, self.cfg.vocab_size))
    return jnp.einsum("btd,dv->btv", x_BxTxD, w_DxV)


def build(cfg: ModelConfig, ctx: ParallelCtx = ParallelCtx()) -> Transformer:
  return Transformer(cfg, ctx)


def init_params(model: Transformer, rng, batch: int = 1, seq: int = 8):
  """Initialises (boxed, logically annotated) params; use under jit/eval_shape for big models."""
  tokens = jnp.zeros((batch, seq), jnp.int32)
  return model.init(rng, tokens)["params"]


def abstract_params(model: Transformer):
  """Shapes/dtypes/logical axes of all params without allocating (works for 70B-class configs)."""
  return jax.eval_shape(lambda: init_params(model, jax.random.key(0)))


def kv_cache_shape(cfg: ModelConfig, batch: int, max_len: int, dtype=None):
  dtype = dtype or _dtype(cfg.dtype)
  shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.hd)
  return (jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape, dtype))


def init_kv_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None):
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), kv_cache_shape(cfg, batch, max_len, dtype))
