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

import functools

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
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
  """``jnp.einsum`` whose contraction is :func:`dot_general`."""
  return jnp.einsum(subscripts, x, w, _dot_general=dot_general)
