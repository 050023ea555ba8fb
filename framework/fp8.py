"""fp8 matmuls (``model.matmul_precision='fp8'``): scaled e4m3 dots forward, e5m2 gradients backward.

What is scaled, and how: every operand of a projection matmul (activation and weight going in, the output's
gradient coming back) is scaled as one tensor by its *current* absolute maximum, ``scale = amax / fp8_max``,
divided by the scale, clipped and cast to fp8: ``float8_e4m3fn`` (max 448, 3 mantissa bits) for the forward
operands, ``float8_e5m2`` (max 57344, 2 mantissa bits) for the gradient. The dot runs on the fp8 operands with
a float output in the compute dtype, multiplied back by the two scales. The backward computes both input
gradients as fp8 dots of the e5m2 gradient with the saved e4m3 operands (e5m2 x e4m3, which cuBLASLt
supports). This is torchtitan's default float8 recipe (dynamic tensorwise scaling); MaxText's ``fp8`` uses
*delayed* scaling instead (scales from an amax history kept in the train state).

Where the scales live: nowhere between steps. Each is computed from the tensor it scales in the same call,
so fp8 adds nothing to the train state or to checkpoints.

Weights are quantized once per step (:func:`weight_cache`), as Transformer Engine casts a weight on a step's first
micro-batch and torchtitan precomputes its weights' scales: the train step quantizes the projection weights before
its micro-batch loop (or pipeline ticks), each layer of a stacked weight with its own scale, and passes them to the
model in the ``fp8`` collection. A projection then reads its weight's e4m3 value from there (under FSDP it
all-gathers the fp8 shards, half the bytes of bf16) and its gradient flows to the parameter through
:class:`Quantized`. The numbers are the same as quantizing the weight in every matmul: same tensor, same scale.

Amax across devices: under ``jax.jit`` an operand's amax is a reduction over the whole (sharded) tensor, so
GSPMD adds a scalar all-reduce where the tensor is split. Inside ``shard_map`` the local maximum is followed
by a ``pmax`` over the mesh axes the operand varies over (its vma type), except ``pipeline``: pipeline stages
hold different tensors. Either way every layout quantizes with the single-device scale. This costs one small
all-reduce per sharded operand per matmul, on the critical path (torchtitan scales activations per rank
instead, without communication, at the price of layout-dependent numerics).

The operand dtypes reach XLA as they are: on H100/H200 XLA rewrites the dots into cuBLASLt fp8 GEMMs
(``__cublas$lt$matmul$f8``); on a CPU the fp8 values are widened and multiplied in float32. The quantize /
dequantize helpers are Flax's (``flax.linen.fp8_ops``); the transposes of the backward are Flax's too.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
CACHE = "fp8"  # the flax collection of the step's quantized weights (weight_cache)
STAGE_AXIS = "pipeline"  # devices along it hold different tensors (pipeline stages): amax is never reduced over it


def _varying(x) -> frozenset:
  """Mesh axes over which ``x`` may differ between devices (inside shard_map; empty elsewhere)."""
  aval = jax.typeof(x)
  if hasattr(aval, "vma"):
    return frozenset(aval.vma)
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def _vary(x, axes):
  missing = tuple(sorted(a for a in axes if a not in _varying(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def amax(x):
  """max |x| over the whole tensor, across the devices that hold pieces of it (see the module doc)."""
  m = jnp.max(jnp.abs(x)).astype(jnp.float32)
  axes = tuple(sorted(a for a in _varying(m) if a != STAGE_AXIS))
  return jax.lax.pmax(m, axes) if axes else m


def scale_for(x, q_dtype):
  """Current tensorwise scale: amax / fp8 max (1 for an all-zero or non-finite tensor, so nothing divides by 0)."""
  a = amax(x)
  return jnp.where((a > 0) & jnp.isfinite(a), a / fp8_ops.get_fp8_max(q_dtype, jnp.float32), 1.0)


def _quantize(x, q_dtype):
  s = scale_for(x, q_dtype)
  return fp8_ops.quantize(x, q_dtype, s, x.dtype), s


def _fwd(lhs, rhs, dimension_numbers):
  out_dtype = jnp.result_type(lhs, rhs)
  q_lhs, s_lhs = _quantize(lhs, E4M3)
  q_rhs, s_rhs = _quantize(rhs, E4M3)
  y = jax.lax.dot_general(q_lhs, q_rhs, dimension_numbers, preferred_element_type=out_dtype)
  y = fp8_ops.dequantize(y, out_dtype, s_lhs * s_rhs)
  return y, (q_lhs, s_lhs, q_rhs, s_rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_dot(lhs, rhs, dimension_numbers):
  return _fwd(lhs, rhs, dimension_numbers)[0]


def _bwd(dimension_numbers, res, g):
  q_lhs, s_lhs, q_rhs, s_rhs = res
  q_g, s_g = _quantize(g, E5M2)
  kw = dict(dimension_numbers=dimension_numbers, precision=None, preferred_element_type=g.dtype)
  d_lhs = fp8_ops.dequantize(fp8_ops.dot_general_transpose_lhs(q_g, q_lhs, q_rhs, **kw), g.dtype, s_g * s_rhs)
  d_rhs = fp8_ops.dequantize(fp8_ops.dot_general_transpose_rhs(q_g, q_lhs, q_rhs, **kw), g.dtype, s_g * s_lhs)
  return d_lhs, d_rhs


_fp8_dot.defvjp(lambda lhs, rhs, dn: _fwd(lhs, rhs, dn), _bwd)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
  """``lax.dot_general`` as a scaled fp8 dot (``precision`` and ``preferred_element_type`` are ignored: the
  output has the operands' dtype). Inside shard_map both operands are first typed as varying over the same
  axes, so the backward returns gradients of the operands' own type (the transposes of those casts are the
  usual ``psum``-s)."""
  del precision, preferred_element_type, kwargs
  axes = _varying(lhs) | _varying(rhs)
  return _fp8_dot(_vary(lhs, axes), _vary(rhs, axes), dimension_numbers)


def einsum(subscripts: str, x, w):
  """``jnp.einsum`` whose contraction is :func:`dot_general`; with a :class:`Quantized` weight, the fp8 dot of
  ``x`` with its cached e4m3 value."""
  if isinstance(w, Quantized):
    return _cached_einsum(subscripts, x, w)
  return jnp.einsum(subscripts, x, w, _dot_general=dot_general)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "q", "q_t", "scale"],
                   meta_fields=["to_compute"])
@dataclasses.dataclass(frozen=True)
class Quantized:
  """A projection weight quantized before the step's micro-batch loop. ``w``: the parameter as stored (this
  device's shard, ``param_dtype``), where the gradient goes; ``to_compute``: the linear map from it to the weight
  the matmul multiplies (FSDP gather, cast to ``dtype``); ``q``, ``scale``: that weight's e4m3 value and scale;
  ``q_t``: the same value with its dims reversed, a second copy that only the backward reads (Transformer
  Engine's column-wise copy: the forward and the backward GEMM each want the weight's other dim contiguous, and
  with one copy XLA transposes it, in a pipeline the whole stage's stack, inside the loop)."""
  w: jax.Array
  q: jax.Array
  q_t: jax.Array
  scale: jax.Array
  to_compute: object


def weight_cache(params, ranks: dict, dtype):
  """The ``fp8`` collection for ``params``: for each weight named in ``ranks`` (name -> its rank unstacked),
  ``(q, q_t, scale)`` of its value in ``dtype`` (``q_t``: ``q`` with the weight's dims reversed), one scale per
  layer of a scanned / pipelined stack (the leading axes beyond the rank)."""
  def walk(tree):
    out = {}
    for k, v in tree.items():
      if isinstance(v, dict):
        sub = walk(v)
        if sub:
          out[k] = sub
      elif k in ranks:
        out[k] = _quantize_stack(v.astype(dtype), v.ndim - ranks[k])
    return out
  return walk(params)


def _quantize_stack(w, n_lead: int):
  m = jnp.max(jnp.abs(w), axis=tuple(range(n_lead, w.ndim))).astype(jnp.float32)
  axes = tuple(sorted(a for a in _varying(m) if a != STAGE_AXIS))
  m = jax.lax.pmax(m, axes) if axes else m
  s = jnp.where((m > 0) & jnp.isfinite(m), m / fp8_ops.get_fp8_max(E4M3, jnp.float32), 1.0)
  q = fp8_ops.quantize(w, E4M3, s.reshape(s.shape + (1,) * (w.ndim - n_lead)), w.dtype)
  return q, q.transpose(tuple(range(n_lead)) + tuple(reversed(range(n_lead, w.ndim)))), s


def _einsum_dims(subscripts: str):
  """(dot_general dimension numbers, permutation of its output into the einsum's) for a two-operand einsum
  without repeated or summed-out indices."""
  ins, out = subscripts.replace(" ", "").split("->")
  a, b = ins.split(",")
  batch = [c for c in a if c in b and c in out]
  contract = [c for c in a if c in b and c not in out]
  dn = ((tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
        (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
  natural = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
  return dn, tuple(natural.index(c) for c in out)


def _cached_einsum(subscripts: str, x, wq: Quantized):
  dn, perm = _einsum_dims(subscripts)
  axes = _varying(x) | _varying(wq.q)
  to_compute = functools.partial(_typed, wq.to_compute, tuple(sorted(axes)))
  from_compute = jax.linear_transpose(to_compute, wq.w)
  y = _cached_dot(_vary(x, axes), wq.w, _vary(wq.q, axes), _vary(wq.q_t, axes), wq.scale, dn, from_compute)
  return y if perm == tuple(range(len(perm))) else y.transpose(perm)


def _typed(to_compute, axes, w):
  return _vary(to_compute(w), axes)


def _cached_fwd(lhs, w, q_rhs, q_rhs_t, s_rhs, dimension_numbers, from_compute):
  del w  # only its gradient is computed here
  out_dtype = lhs.dtype
  q_lhs, s_lhs = _quantize(lhs, E4M3)
  y = jax.lax.dot_general(q_lhs, q_rhs, dimension_numbers, preferred_element_type=out_dtype)
  return fp8_ops.dequantize(y, out_dtype, s_lhs * s_rhs), (q_lhs, s_lhs, q_rhs_t, s_rhs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _cached_dot(lhs, w, q_rhs, q_rhs_t, s_rhs, dimension_numbers, from_compute):
  return _cached_fwd(lhs, w, q_rhs, q_rhs_t, s_rhs, dimension_numbers, from_compute)[0]


def _cached_bwd(dimension_numbers, from_compute, res, g):
  q_lhs, s_lhs, q_rhs_t, s_rhs = res
  q_rhs = q_rhs_t.transpose(tuple(reversed(range(q_rhs_t.ndim))))  # the backward's own copy, read as the weight
  d_lhs, d_rhs = _bwd(dimension_numbers, (q_lhs, s_lhs, q_rhs, s_rhs), g)
  (d_w,) = from_compute(d_rhs)
  return d_lhs, d_w, jnp.zeros_like(q_rhs), jnp.zeros_like(q_rhs_t), jnp.zeros_like(s_rhs)


_cached_dot.defvjp(_cached_fwd, _cached_bwd)
