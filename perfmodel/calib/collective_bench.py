"""The marginal cost of one collective *inside* a program, over a 2-device mesh axis ``x``.

Shared by ``python -m perfmodel calibrate`` (2 virtual devices in one process: the ``cpu`` profile's
``collective_curve``) and perfmodel/emulate/gloo_calibration.py (2 real processes over gloo).

Why marginal: a collective in a training step pays the collective, not a jitted call's dispatch. Timed one per call,
the 2-device call's own dispatch dominates every point (an in-process all-reduce reads a flat ~80 us from 1 KB to
64 KB, while a collective-permute chained inside a program costs 13.5-17.5 us at 16-64 KB). So: K collectives
chained in one compiled loop, minus the same loop with local work in their place.

jax is imported inside the functions: the gloo processes that import this module set their allocator and
collectives implementation before jax loads.
"""
from __future__ import annotations

from perfmodel.calib import bench

KINDS = ("all-reduce", "all-gather", "collective-permute")


def local_elems(kind: str, size: float) -> int:
  """f32 elements per device for payload ``size`` (perfmodel/cost/collectives.py convention: all-reduce / permute
  operand, all-gather result, reduce-scatter operand)."""
  return max(1, int(size) // (8 if kind in ("all-gather", "reduce-scatter") else 4))


def issue(kind: str, vs: tuple, locals_) -> tuple:
  """The collective ``kind`` over axis 'x' on buffers ``vs``, issued together (one multi-operand psum /
  ppermute, as a program's combined call); each result has its input's shape, so calls chain."""
  import jax  # noqa: PLC0415 (jax-free at import: gloo_calibration imports this module before host_memory.apply())
  import jax.numpy as jnp  # noqa: PLC0415 (jax-free at import: gloo_calibration imports this module before host_memory.apply())
  if not vs:
    return ()
  if kind == "all-reduce":
    return tuple(v * 0.5 for v in jax.lax.psum(vs, "x"))
  if kind == "all-gather":
    return tuple(jax.lax.all_gather(v, "x", tiled=True)[:n] * 0.5 for v, n in zip(vs, locals_))
  if kind == "reduce-scatter":
    return tuple(jax.lax.psum_scatter(jnp.concatenate([v, v]), "x", tiled=True) * 0.5 for v in vs)
  return tuple(v * 0.5 for v in jax.lax.ppermute(vs, "x", [(0, 1), (1, 0)]))


def chained(mesh, kind: str, local: int, k: int, real: bool):
  """A jitted 2-device program: ``k`` chained collectives of ``kind`` on a ``local``-element buffer per device
  (``real``), or the same loop with local work in their place."""
  import jax  # noqa: PLC0415 (jax-free at import: gloo_calibration imports this module before host_memory.apply())
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415 (jax-free at import: gloo_calibration imports this module before host_memory.apply())

  def step(i, v):
    return issue(kind, (v,), [local])[0] if real else v * 0.5

  def body(v):
    return jax.lax.fori_loop(0, k, step, v)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))


def marginal_curve(mesh, kind: str, sizes, k: int = 8, reps: int = 7) -> list:
  """[[payload bytes, seconds per collective], ...]: (loop with ``k`` collectives - loop without) / k, timed in
  alternating blocks (bench.time_slope, so the host's drift hits both) in the regime's clock."""
  import jax  # noqa: PLC0415 (jax-free at import: gloo_calibration imports this module before host_memory.apply())
  import numpy as np  # noqa: PLC0415 (jax-free at import: gloo_calibration imports this module before host_memory.apply())
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415 (jax-free at import: gloo_calibration imports this module before host_memory.apply())
  pts = []
  for size in sizes:
    local = local_elems(kind, size)
    x = jax.device_put(np.ones((2 * local,), np.float32), NamedSharding(mesh, P("x")))
    f0, f1 = chained(mesh, kind, local, k, False), chained(mesh, kind, local, k, True)
    r = bench.time_slope(lambda: f0(x), lambda: f1(x), 0.0, float(k), reps=reps, block=2)
    # under load the difference can go negative: a collective is never free
    pts.append([float(size), max(1e-7, bench.seconds(r))])
  return pts
