"""Calibrates the cost of gloo collectives between 2 real processes over loopback (XLA:CPU, jax.distributed).

Why a separate calibration: the ``cpu`` profile's ``collective_curve`` (``python -m perfmodel calibrate``)
times psum / all_gather between 2 *virtual devices inside one process* (shared memory, no gloo). A
real ``experiments.run --processes 2`` job pays gloo over TCP loopback, synchronously, on the same
core as its compute. This measures exactly that: 2 processes pinned one per core, a ``shard_map``
over a 2-device mesh (one device per process), each collective kind (all-reduce, all-gather,
reduce-scatter, collective-permute) at payloads 1 KB..16 MB, K collectives chained inside one
jitted loop (dispatch amortised), minus the same loop with the collective replaced by local work.
Each collective follows a burst of compute (a ~1 ms matmul chain on a buffer of its own, ``burst_dim``) as in
a training step: a collective issued straight after another finds its peer already waiting and the payload
hot in cache, one issued after compute pays the hand-off between the two processes (the peer's wake-up, the
payload written by compute) - measured here, that makes a real step's collectives 20-60% dearer than
back-to-back ones. ``burst_dim=0`` gives the back-to-back curves.

  python -m perfmodel.emulate.gloo_calibration            # ~1-2 min; writes perfmodel/emulate/calibration/cpu_gloo.json

The result is data (``[[payload bytes, seconds], ...]`` per kind, n=2, payload in the
``perfmodel.collectives`` convention). The hook into the shared collective model is
:func:`with_gloo_curves`: it returns the profile with this ``collective_curve`` (the field
``perfmodel.collectives.cost`` already prices from), so ``perfmodel/collectives.py`` is unchanged.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time

DEFAULT_PATH = os.path.join(os.path.dirname(__file__), "calibration", "cpu_gloo.json")
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
SIZES = tuple(4 ** p for p in range(5, 13))  # 1 KB .. 16 MB
BURST_DIM = 384  # compute burst before each collective: a 384^3 matmul + tanh, ~1 ms on one core here


def with_gloo_curves(hw, path: str = DEFAULT_PATH):
  """``hw`` with the measured 2-process gloo curves as its collective_curve (unchanged if none)."""
  if not os.path.exists(path):
    return hw, None
  with open(path) as f:
    cal = json.load(f)
  return dataclasses.replace(hw, collective_curve={k: [tuple(p) for p in v] for k, v in cal["curves"].items()}), cal


def _child(coord: str, pid: int, reps: int, k: int, burst_dim: int = 0) -> None:
  import jax  # noqa: PLC0415
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coord, num_processes=2, process_id=pid)
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))

  def make(kind: str, local_elems: int, real: bool):
    def one(v):
      if not real:
        return v * 0.5 + 1.0
      if kind == "all-reduce":
        return jax.lax.psum(v, "x") * 0.5
      if kind == "all-gather":
        return jax.lax.all_gather(v, "x", tiled=True)[:local_elems] * 0.5
      if kind == "reduce-scatter":
        w = jnp.concatenate([v, v])
        return jax.lax.psum_scatter(w, "x", tiled=True) * 0.5
      return jax.lax.ppermute(v, "x", [(0, 1), (1, 0)]) * 0.5

    def step(i, carry):
      x, m = carry
      if burst_dim:
        # compute burst; its result feeds the payload (x + 0*m) so the collective waits for it
        m = jnp.tanh(m @ m) * 0.5
        x = x + 0.0 * m[0, 0]
      return one(x), m

    def body(v):
      m0 = jnp.full((max(1, burst_dim),) * 2, 0.01, jnp.float32) + jax.lax.axis_index("x").astype(jnp.float32)
      return jax.lax.fori_loop(0, k, step, (v, m0))[0]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))

  out = {}
  for kind in KINDS:
    pts = []
    for size in SIZES:
      # payload S (perfmodel convention): AR/permute operand, AG result, RS operand; all f32
      local = {"all-gather": size // 8, "reduce-scatter": size // 8}.get(kind, size // 4)
      x = jax.device_put(np.ones((2 * local,), np.float32), NamedSharding(mesh, P("x")))
      per = []
      for real in (True, False):
        f = make(kind, local, real)
        jax.block_until_ready(f(x))
        ts = []
        for _ in range(reps):
          t0 = time.perf_counter()
          jax.block_until_ready(f(x))
          ts.append(time.perf_counter() - t0)
        per.append(statistics.median(ts))
      pts.append([float(size), max(per[0] - per[1], 1e-7) / k, per[0] / k, per[1] / k])
    out[kind] = pts
  if pid == 0:
    print("@@" + json.dumps(out))


def calibrate(path: str = DEFAULT_PATH, reps: int = 7, k: int = 8, timeout_s: float = 600.0,
              burst_dim: int = BURST_DIM) -> dict:
  from parallelism.distributed import free_port  # noqa: PLC0415
  from perfmodel.emulate import localrun  # noqa: PLC0415
  cores = localrun.cores()
  if len(cores) < 2:
    raise RuntimeError("gloo calibration needs 2 cores (one per process)")
  coord = f"127.0.0.1:{free_port()}"
  load0 = os.getloadavg()[0]
  cmds = [localrun.python("-m", "perfmodel.emulate.gloo_calibration", "--child", coord, str(i), str(reps), str(k),
                          str(burst_dim)) for i in range(2)]
  done = localrun.run_pinned(cmds, cores[:2], timeout_s=timeout_s)
  if done.rc != [0, 0]:
    raise RuntimeError(f"gloo calibration failed rc={done.rc}: {done.stderr[0][-3000:]}{done.stderr[1][-2000:]}")
  raw = json.loads([l for l in done.stdout[0].splitlines() if l.startswith("@@")][0][2:])
  res = {"curves": {k_: [[p[0], p[1]] for p in v] for k_, v in raw.items()},
         "raw_with_collective_s": {k_: [[p[0], p[2]] for p in v] for k_, v in raw.items()},
         "raw_local_only_s": {k_: [[p[0], p[3]] for p in v] for k_, v in raw.items()},
         "source": (f"python -m perfmodel.emulate.gloo_calibration on {platform.node()} "
                    f"{datetime.datetime.now().isoformat(timespec='minutes')}: 2 processes pinned one per core, "
                    f"jax.distributed + gloo over 127.0.0.1, shard_map over 2 devices, {k} collectives per jit call, "
                    f"each after a {burst_dim}^3 matmul burst, minus the same loop without the collective, "
                    f"median of {reps}"),
         "burst_dim": burst_dim,
         "n": 2, "load_avg_1m": [load0, os.getloadavg()[0]], "wall_s": done.wall_s}
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(res, f, indent=1)
  return res


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
           int(sys.argv[6]) if len(sys.argv) > 6 else 0)
  else:
    r = calibrate()
    print(json.dumps({"curves": r["curves"], "load_avg_1m": r["load_avg_1m"], "wall_s": r["wall_s"]}))
