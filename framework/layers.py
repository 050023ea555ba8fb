"""The layers a decoder is built from: how a layer sees the mesh (:class:`ParallelCtx`), the base module every
layer derives from (its parameters at their logical axes, local in manual mode and gathered before use; projection
matmuls in ``dtype`` or fp8; the tensor-parallel prologue and epilogue; remat tags), RMSNorm and the two
feed-forward layers, the gated MLP and the mixture of experts (its routing and dispatch in framework/moe.py).

framework/model.py assembles them, with attention, into the decoder; its docstring gives the parameter tree and the
two modes (auto under ``jax.jit``, manual inside ``jax.shard_map``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from framework import fp8
from framework import moe as moe_lib
from framework import remat as remat_lib
from framework.config import ModelConfig

# Logical axes of every parameter, by its name. Sharding rules (parallelism/rules.py) map these
# logical names to mesh axes; this table is the single place that says what each dim *is*.
PARAM_AXES = {
    "embedding": ("embed_vocab", "embed"),
    "wq": ("embed", "q_heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("q_heads", "head_dim", "embed"),
    "bq": ("q_heads", "head_dim"),  # qkv_bias: each bias shards like its projection's heads
    "bk": ("kv_heads", "head_dim"),
    "bv": ("kv_heads", "head_dim"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "scale": ("norm",),
    "kernel": ("embed", "vocab"),
    "router": ("embed", "router"),  # mixture of experts (framework/moe.py)
    "router_bias": ("router",),  # the balancing bias (model.router_bias_rate): float32, replicated
    "we_gate": ("experts", "embed", "expert_mlp"),
    "we_up": ("experts", "embed", "expert_mlp"),
    "we_down": ("experts", "expert_mlp", "embed"),
}


@dataclasses.dataclass(frozen=True)
class ParallelCtx:
  """How the model sees the mesh. Default: auto mode (no manual collectives)."""
  manual: bool = False
  # logical axis -> tuple of mesh axes (only needed in manual mode)
  rules: tuple = ()
  axis_sizes: tuple = ()  # ((mesh_axis, size), ...)
  tensor_axis: Optional[str] = None  # axis of Megatron TP inside shard_map
  sequence_axis: Optional[str] = None  # axis of sequence/context parallelism inside shard_map
  expert_axis: Optional[str] = None  # axis of expert parallelism inside shard_map (its dims stay local)
  # The scanned layer stack is stored as layer_repeats x (n_layers / layer_repeats) (logical axes 'layer_repeats',
  # 'layers'): sharding 'layers' over P pipeline stages then places chunks round-robin, layer order unchanged
  # (virtual pipeline stages, parallelism/schedules.py).
  layer_repeats: int = 1
  # Megatron sequence parallelism over tensor_axis (mesh.tensor_sequence_parallel): see tp_sequence_sharded.
  tensor_sequence_parallel: bool = False

  @property
  def tp_sequence_sharded(self) -> bool:
    """True when activations between the matmuls hold this tensor rank's ``T/tensor`` chunk of the sequence."""
    return (self.manual and self.tensor_sequence_parallel and bool(self.tensor_axis)
            and self.size((self.tensor_axis,)) > 1)

  def mesh_axes(self, logical: str) -> tuple:
    for name, axes in self.rules:
      if name == logical:
        if axes is None:
          return ()
        return (axes,) if isinstance(axes, str) else tuple(axes)
    return ()

  def size(self, axes: Sequence[str]) -> int:
    sizes = dict(self.axis_sizes)
    return math.prod(sizes.get(a, 1) for a in axes)

  def local_shape(self, shape, logical):
    return tuple(s // self.size(self.mesh_axes(l)) for s, l in zip(shape, logical))

  def gather(self, w, logical):
    """All-gathers every dim sharded over mesh axes other than tensor and expert (FSDP / ZeRO-3 style)."""
    for dim, l in enumerate(logical):
      # size-1 axes are left out (as parallelism.shard_map_step.strip_trivial leaves them out of the specs): a
      # gather over one would type the weight, and everything computed from it, as varying over that axis
      axes = tuple(a for a in self.mesh_axes(l)
                   if a not in (self.tensor_axis, self.expert_axis) and self.size((a,)) > 1)
      if axes:
        w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    return w


def _dtype(name: str):
  return jnp.dtype(name)


class _Base(nn.Module):
  cfg: ModelConfig
  ctx: ParallelCtx = ParallelCtx()

  def weight(self, name: str, shape: tuple, init=None):
    """Declares a parameter (local shape in manual mode) and returns it ready to use."""
    logical = PARAM_AXES[name]
    init = init or nn.initializers.normal(self.cfg.init_std)
    if self.ctx.manual:
      w = self.param(name, init, self.ctx.local_shape(shape, logical), _dtype(self.cfg.param_dtype))
    else:
      w = self.param(name, nn.with_logical_partitioning(init, logical), shape, _dtype(self.cfg.param_dtype))
    gather = functools.partial(self.ctx.gather, logical=logical) if self.ctx.manual else (lambda a: a)
    if self.has_variable(fp8.CACHE, name):  # quantized once per step (fp8_cache): its fp8 value, gathered
      q, q_t, scale = self.get_variable(fp8.CACHE, name)
      q_t = self.ctx.gather(q_t, logical[::-1]) if self.ctx.manual else q_t
      return fp8.Quantized(w, gather(q), q_t, scale, lambda a: gather(a).astype(_dtype(self.cfg.dtype)))
    return gather(w).astype(_dtype(self.cfg.dtype))

  def project(self, subscripts: str, x, w):
    """A projection matmul (q/k/v/out, MLP): in ``dtype``, or scaled fp8 (``matmul_precision``, framework/fp8.py)."""
    if self.cfg.matmul_precision == "fp8":
      return fp8.einsum(subscripts, x, w)
    return jnp.einsum(subscripts, x, w)

  def tp_reduce(self, y_BxTxD):
    """Row-parallel matmul epilogue: sum partial results across the tensor axis; under sequence parallelism a
    reduce-scatter that leaves this rank's chunk of the sequence (the residual stream's layout)."""
    if self.ctx.tp_sequence_sharded:
      return jax.lax.psum_scatter(y_BxTxD, self.ctx.tensor_axis, scatter_dimension=1, tiled=True)
    if self.ctx.manual and self.ctx.tensor_axis and self.ctx.size((self.ctx.tensor_axis,)) > 1:
      return jax.lax.psum(y_BxTxD, self.ctx.tensor_axis)
    return y_BxTxD

  def tp_gather(self, x_BxTxD):
    """Column-parallel prologue under sequence parallelism: the chunks of the tensor ranks -> the whole sequence
    (all-gather along T; its transpose reduce-scatters the input's gradient). Identity otherwise."""
    if self.ctx.tp_sequence_sharded:
      return jax.lax.all_gather(x_BxTxD, self.ctx.tensor_axis, axis=1, tiled=True)
    return x_BxTxD

  def tag(self, x, name: str):
    """Names an activation for the remat policies that select by name; a no-op for the others, so their
    programs carry no name markers at all."""
    if remat_lib.uses_names(self.cfg.remat):
      return checkpoint_name(x, name)
    return x

  def constrain(self, x, logical):
    if self.ctx.manual:
      return x
    return nn.with_logical_constraint(x, logical)


def _rms(x, scale_D, eps: float):
  """(float32 x / rms(x), 1 / rms(x)) over the last dim."""
  xf = x.astype(jnp.float32)
  r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return xf * r, r


def _row(v, ndim: int):
  # explicit broadcast: the test suite runs with jax_numpy_rank_promotion='raise'
  return v.astype(jnp.float32).reshape((1,) * (ndim - 1) + v.shape)


def _like(ct, primal):
  """A cotangent typed like its primal inside shard_map: summed over the mesh axes it varies over and the primal
  does not (what autodiff's transpose of the implicit broadcast does), made varying over the ones it lacks."""
  extra = tuple(sorted(fp8._varying(ct) - fp8._varying(primal)))
  ct = jax.lax.psum(ct, extra) if extra else ct
  return fp8._vary(ct, fp8._varying(primal)).astype(primal.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x, scale_D, eps: float, dtype):
  """``x / rms(x) * scale`` in float32, returned in ``dtype``. Its backward keeps what a fused norm kernel keeps
  (the input in its own dtype) and recomputes the rest, where autodiff would stash float32 copies of the
  normalised input: without remat 2 bytes per element of a layer's two norms instead of 16."""
  n, _ = _rms(x, scale_D, eps)
  return (n * _row(scale_D, x.ndim)).astype(dtype)


def _rms_norm_fwd(x, scale_D, eps, dtype):
  return rms_norm(x, scale_D, eps, dtype), (x, scale_D)


def _rms_norm_bwd(eps, dtype, res, g):
  # autodiff of the forward, recomputed from the kept input
  x, scale_D = res
  dx, dscale = jax.vjp(lambda a, s: (_rms(a, s, eps)[0] * _row(s, a.ndim)).astype(dtype), x, scale_D)[1](g)
  return _like(dx, x), _like(dscale, scale_D)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _gelu_d(u):
  """d/du of tanh-approximated GELU, in float32."""
  u = u.astype(jnp.float32)
  c = math.sqrt(2 / math.pi)
  t = jnp.tanh(c * (u + 0.044715 * u ** 3))
  return 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * c * (1 + 3 * 0.044715 * u * u)


@jax.custom_vjp
def gelu(u):
  """Tanh-approximated GELU whose backward keeps only its input (a fused activation kernel's residual)."""
  return nn.gelu(u, approximate=True)


gelu.defvjp(lambda u: (gelu(u), u), lambda u, g: (_like(g.astype(jnp.float32) * _gelu_d(u), u),))


@jax.custom_vjp
def swiglu(g, u):
  """``silu(g) * u``; its backward keeps only the two inputs (Megatron's fused bias-SwiGLU keeps the same)."""
  return nn.silu(g) * u


def _swiglu_bwd(res, dh):
  g, u = res
  gf, uf, dh = g.astype(jnp.float32), u.astype(jnp.float32), dh.astype(jnp.float32)
  sig = jax.nn.sigmoid(gf)
  dg = dh * uf * sig * (1 + gf * (1 - sig))
  return _like(dg, g), _like(dh * gf * sig, u)


swiglu.defvjp(lambda g, u: (swiglu(g, u), (g, u)), _swiglu_bwd)


class RMSNorm(_Base):
  @nn.compact
  def __call__(self, x_BxTxD):
    scale = self.weight("scale", (self.cfg.d_model,), nn.initializers.ones)
    return rms_norm(x_BxTxD, scale, self.cfg.norm_eps, _dtype(self.cfg.dtype))


class MLP(_Base):
  """swiglu: w_down(silu(x w_gate) * x w_up); gelu / relu: w_down(act(x w_up)). ``reduce=False`` leaves the
  row-parallel output partial over the tensor axis (the MoE layer sums it with the experts' before one reduce)."""
  reduce: bool = True

  @nn.compact
  def __call__(self, x_BxTxD):
    c = self.cfg
    D, F = c.d_model, c.ff
    if c.gated:
      w_gate, w_up, w_down = self.weight("w_gate", (D, F)), self.weight("w_up", (D, F)), self.weight("w_down", (F, D))
      h_BxTxF = swiglu(self.tag(self.project("btd,df->btf", x_BxTxD, w_gate), remat_lib.MLP_IN_GATE),
                       self.tag(self.project("btd,df->btf", x_BxTxD, w_up), remat_lib.MLP_IN_UP))
    else:
      w_up, w_down = self.weight("w_up", (D, F)), self.weight("w_down", (F, D))
      act = {"gelu": gelu, "relu": nn.relu}[c.mlp]
      h_BxTxF = act(self.tag(self.project("btd,df->btf", x_BxTxD, w_up), remat_lib.MLP_IN))
    h_BxTxF = self.constrain(h_BxTxF, ("batch", "seq", "act_mlp"))
    out_BxTxD = self.project("btf,fd->btd", h_BxTxF, w_down)
    return self.tag(self.tp_reduce(out_BxTxD) if self.reduce else out_BxTxD, remat_lib.MLP_OUT)


class MoE(_Base):
  """Mixture of experts in place of the MLP (framework/moe.py): router, routed gated experts, shared experts.
  Sows into the ``moe`` collection (read when the caller makes it mutable): ``aux``, the sum over this device's
  sequences of the balance loss, and ``load``, assignments per expert (and ``dropped`` with ``moe_impl='capacity'``).

  Under Megatron sequence parallelism each tensor rank routes and dispatches its own chunk of the sequence
  (``moe_lib.tensor_parallel``): an expert-parallel exchange moves ``1/tensor`` of the tokens; the router
  statistics are summed over the tensor ranks."""

  @nn.compact
  def __call__(self, chunk_BxTxD):
    """``chunk_BxTxD``: the normed input, under sequence parallelism this tensor rank's chunk of the sequence."""
    c, ctx = self.cfg, self.ctx
    chunked = ctx.tp_sequence_sharded
    x_BxTxD = self.tp_gather(chunk_BxTxD) if (not chunked or c.n_shared_experts) else None
    mine_BxTxD = chunk_BxTxD if chunked else x_BxTxD  # the tokens this rank routes and dispatches
    b, t, d = mine_BxTxD.shape
    E, F, k = c.n_experts, c.expert_ff, c.experts_per_token
    router = self.weight("router", (d, E)).astype(jnp.float32)
    logits_BxTxE = jnp.einsum("btd,de->bte", mine_BxTxD.astype(jnp.float32), router)
    bias = None
    if c.router_bias_rate:  # float32 whatever param_dtype is: its steps (the rate) are far below bf16's resolution
      init = nn.initializers.zeros
      bias = self.param(moe_lib.BIAS, init if ctx.manual else nn.with_logical_partitioning(
          init, PARAM_AXES[moe_lib.BIAS]), (E,), jnp.float32)
    w_BxTxK, ids_BxTxK, probs_BxTxE = moe_lib.route(logits_BxTxE, k, c.router, c.moe_norm_topk, bias)
    seq_axis = ctx.sequence_axis if ctx.manual and ctx.sequence_axis and ctx.size((ctx.sequence_axis,)) > 1 else None
    split = tuple(a for a in (seq_axis, ctx.tensor_axis if chunked else None) if a)  # axes the sequence is cut over
    self.sow("moe", "aux", moe_lib.balance(ids_BxTxK, probs_BxTxE, t * ctx.size(split), split or None))
    load_E = jnp.sum(moe_lib.expert_counts(ids_BxTxK, E), axis=0)
    self.sow("moe", "load", jax.lax.psum(load_E, ctx.tensor_axis) if chunked else load_E)
    wg, wu, wd = self.weight("we_gate", (E, d, F)), self.weight("we_up", (E, d, F)), self.weight("we_down", (E, F, d))
    ep_axis = ctx.expert_axis if ctx.manual and ctx.expert_axis and ctx.size((ctx.expert_axis,)) > 1 else None
    ep = ctx.size((ep_axis,)) if ep_axis else 1
    tp = ctx.size((ctx.tensor_axis,)) if chunked else 1
    x_NxD, ids_NxK, w_NxK = mine_BxTxD.reshape(b * t, d), ids_BxTxK.reshape(b * t, k), w_BxTxK.reshape(b * t, k)
    if c.moe_impl == "capacity":
      def experts(x_ExCxD):  # fp8 under matmul_precision='fp8', as the dense MLP
        x_ExCxD = self.tag(x_ExCxD, remat_lib.MOE_DISPATCH)
        g = self.tag(self.project("ecd,edf->ecf", x_ExCxD, wg), remat_lib.MLP_IN_GATE)
        u = self.tag(self.project("ecd,edf->ecf", x_ExCxD, wu), remat_lib.MLP_IN_UP)
        return self.project("ecf,efd->ecd", swiglu(g, u), wd)
      experts = moe_lib.tensor_parallel(experts, ctx.tensor_axis, tp, grouped=False) if tp > 1 else experts
      y_NxD, dropped = moe_lib.capacity(x_NxD, ids_NxK, w_NxK, experts, E, c.capacity_factor, ep_axis, ep,
                                        tag=lambda y: self.tag(y, remat_lib.MOE_COMBINE))
      self.sow("moe", "dropped", jax.lax.psum(dropped, ctx.tensor_axis) if chunked else dropped)
    else:
      def experts(x_MxD, sizes):
        x_MxD = self.tag(x_MxD, remat_lib.MOE_DISPATCH)
        g = self.tag(jax.lax.ragged_dot(x_MxD, wg, sizes), remat_lib.MLP_IN_GATE)
        u = self.tag(jax.lax.ragged_dot(x_MxD, wu, sizes), remat_lib.MLP_IN_UP)
        return jax.lax.ragged_dot(swiglu(g, u), wd, sizes)
      experts = moe_lib.tensor_parallel(experts, ctx.tensor_axis, tp, grouped=True) if tp > 1 else experts
      y_NxD = moe_lib.dropless(x_NxD, ids_NxK, w_NxK, experts, E, ep_axis, ep,
                               tag=lambda y: self.tag(y, remat_lib.MOE_COMBINE))
    y_BxTxD = y_NxD.reshape(b, t, d) * jnp.asarray(c.router_scale, y_NxD.dtype)
    shared = None
    if c.n_shared_experts:
      shared = MLP(dataclasses.replace(c, d_ff=F * c.n_shared_experts, n_experts=0), ctx, reduce=False,
                   name="shared")(x_BxTxD)
    if chunked:  # the routed output is this rank's chunk, whole; the shared experts' a partial sum of the sequence
      return self.tag(y_BxTxD if shared is None else y_BxTxD + self.tp_reduce(shared), remat_lib.MLP_OUT)
    return self.tag(self.tp_reduce(y_BxTxD if shared is None else y_BxTxD + shared), remat_lib.MLP_OUT)
