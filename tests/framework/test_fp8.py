"""The scaled fp8 dot (framework/fp8.py) against exact float64 products, with error bounds from the formats.

Rounding ``v = x / scale`` (|v| <= the format's max, so nothing overflows) to a format with m stored mantissa bits
and smallest subnormal spacing 2^q errs by at most ``2^-(m+1) |v|`` in the normal range and ``2^(q-1)`` below it,
so every quantized operand satisfies ``|x^ - x| <= e(x) = 2^-(m+1) |x| + 2^(q-1) scale`` elementwise
(e4m3fn: m=3, q=-9; e5m2: m=2, q=-16). A dot of quantized operands then errs by at most
``|x| @ e(w) + e(x) @ |w| + e(x) @ e(w)``, plus float32 accumulation (K 2^-24 of ``|x| @ |w|``).
Those bounds are checked for the forward (e4m3 x e4m3) and for both gradients (e5m2 x e4m3), at magnitudes
that would overflow (1e4) or underflow (1e-4) fp8 without scaling; and the error must also be of fp8's size,
not float32's (a dot that did not quantize would pass the bounds).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from framework import fp8

E4M3 = (3, -9)  # stored mantissa bits, log2 of the subnormal spacing
E5M2 = (2, -16)
MAX = {E4M3: 448.0, E5M2: 57344.0}
DN = (((1,), (0,)), ((), ()))  # (M, K) x (K, N)


def _err(x, fmt):
  """Elementwise bound on |quantized x - x| for per-tensor current scaling into ``fmt``."""
  m, q = fmt
  scale = np.max(np.abs(x)) / MAX[fmt]
  return 2.0 ** -(m + 1) * np.abs(x) + 2.0 ** (q - 1) * scale


def _dot_bound(a, ea, b, eb):
  k = a.shape[1]
  return np.abs(a) @ eb + ea @ np.abs(b) + ea @ eb + k * 2.0 ** -24 * 1.5 * (np.abs(a) @ np.abs(b))


def _operands(scale, seed=0):
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((32, 128)) * scale).astype(np.float32)
  w = (rng.standard_normal((128, 48)) * rng.uniform(0.1, 2.0, 48)).astype(np.float32)
  g = (rng.standard_normal((32, 48)) * 1e-3).astype(np.float32)
  return x, w, g


@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e4])
def test_forward_within_the_e4m3_bound(scale):
  x, w, _ = _operands(scale)
  y = np.asarray(jax.jit(lambda a, b: fp8.dot_general(a, b, DN))(x, w), np.float64)
  exact = x.astype(np.float64) @ w.astype(np.float64)
  bound = _dot_bound(x.astype(np.float64), _err(x, E4M3), w.astype(np.float64), _err(w, E4M3))
  assert np.all(np.abs(y - exact) <= bound)
  # fp8-sized error (a float32 dot would be ~1e-7 of the values)
  assert np.mean(np.abs(y - exact)) > 0.02 * np.mean(bound)


@pytest.mark.parametrize("scale", [1e-4, 1.0, 1e4])
def test_gradients_within_the_e5m2_bound(scale):
  x, w, g = _operands(scale, seed=1)
  _, pullback = jax.vjp(lambda a, b: fp8.dot_general(a, b, DN), x, w)
  dx, dw = (np.asarray(d, np.float64) for d in pullback(jnp.asarray(g)))
  x64, w64, g64 = (v.astype(np.float64) for v in (x, w, g))
  eg = _err(g, E5M2)
  bound_dx = _dot_bound(g64, eg, w64.T, _err(w, E4M3).T)  # dx = g w^T
  bound_dw = _dot_bound(x64.T, _err(x, E4M3).T, g64, eg)  # dw = x^T g
  assert np.all(np.abs(dx - g64 @ w64.T) <= bound_dx)
  assert np.all(np.abs(dw - x64.T @ g64) <= bound_dw)
  assert np.mean(np.abs(dx - g64 @ w64.T)) > 0.02 * np.mean(bound_dx)


def test_zero_operand_gives_zeros_not_nans():
  x = np.zeros((4, 16), np.float32)
  w = np.ones((16, 8), np.float32)
  y, pullback = jax.vjp(lambda a, b: fp8.dot_general(a, b, DN), x, w)
  dx, dw = pullback(jnp.zeros_like(y))
  for v in (y, dx, dw):
    assert np.all(np.asarray(v) == 0)


def test_program_holds_fp8_dots_both_ways():
  """The operands reach XLA as fp8: e4m3 x e4m3 forward, e5m2 x e4m3 in the backward."""
  x, w, _ = _operands(1.0)
  text = jax.jit(jax.grad(lambda a, b: jnp.sum(fp8.einsum("mk,kn->mn", a, b) ** 2), argnums=(0, 1))).lower(
      x, w).as_text()
  dots = [line for line in text.splitlines() if "dot_general" in line]
  assert any(line.count("f8E4M3FN") >= 2 for line in dots)
  assert any("f8E5M2" in line and "f8E4M3FN" in line for line in dots)
