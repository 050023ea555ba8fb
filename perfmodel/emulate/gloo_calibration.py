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

Beside each lone call, the same kind is timed with ``MANY`` buffers issued together (XLA combines them into
one tuple instruction, which XLA:CPU runs as one gloo call per buffer): ``next_curves`` is the cost of each
further buffer of such a combined call.

  python -m perfmodel.emulate.gloo_calibration            # ~1 min; writes ~/.cache/prismllm/emulate/cpu_gloo.json
  python -m perfmodel.emulate.gloo_calibration --commit   # writes the committed perfmodel/emulate/calibration/cpu_gloo.json

Emulation reads the user's curves (``$PRISMLLM_CACHE/emulate/cpu_gloo.json``, else ``~/.cache/prismllm/...``) when
there are some, else the committed ones (the development host's): :func:`current_path`.

The result is data (``[[payload bytes, seconds], ...]`` per kind, n=2, payload in the
``perfmodel.cost.collectives`` convention). The hook into the shared collective model is
:func:`with_gloo_curves`: it returns the profile with ``collective_curve`` / ``collective_next_curve`` set,
the fields ``perfmodel.cost.collectives.cost`` / ``combined_cost`` price from.

:func:`replay` times a program's own calls (kind and every buffer's size) the same way, after compute as long
as the program's: ``emulate --replay-collectives``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from typing import Optional

from parallelism.distributed import free_port
from perfmodel.calib import bench, collective_bench
from perfmodel.cost import collectives
from perfmodel.emulate import localrun
from perfmodel.hardware import cache_root

DEFAULT_PATH = os.path.join(os.path.dirname(__file__), "calibration", "cpu_gloo.json")  # committed (--commit)


def user_path() -> str:
  """Where a calibration on this host goes unless told otherwise: the user's cache, never the repository."""
  return os.path.join(cache_root(), "emulate", "cpu_gloo.json")


def current_path() -> str:
  """The curves emulation prices ``cpu`` collectives with: the user's when measured, else the committed ones."""
  return user_path() if os.path.exists(user_path()) else DEFAULT_PATH
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
SIZES = tuple(4 ** p for p in range(5, 13))  # 1 KB .. 16 MB
MANY = 4  # buffers issued together for the further-operand curve (a combined tuple collective)
BURST_DIM = 384  # compute burst before each collective: a 384^3 matmul + tanh, ~1 ms on one core here


def with_gloo_curves(hw, path: str = DEFAULT_PATH):
  """``hw`` with the measured 2-process gloo curves as its collective_curve (unchanged if none)."""
  if not os.path.exists(path):
    return hw, None
  with open(path) as f:
    cal = json.load(f)
  return dataclasses.replace(
      hw, collective_curve={k: [tuple(p) for p in v] for k, v in cal["curves"].items()},
      collective_next_curve={k: [tuple(p) for p in v] for k, v in cal.get("next_curves", {}).items()}), cal


def _init_child(coord: str, pid: int):
  """One of the 2 gloo processes: jax.distributed up, a 1-D mesh 'x' over the 2 processes' devices."""
  import jax  # noqa: PLC0415 (after host_memory.apply() in __main__: threads start later)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coord, num_processes=2, process_id=pid)
  return jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))


def _child(coord: str, pid: int, reps: int, k: int, burst_dim: int = 0, kinds: tuple = KINDS) -> None:
  mesh = _init_child(coord, pid)
  import jax  # noqa: PLC0415 (after host_memory.apply() in __main__: threads start later)
  import jax.numpy as jnp  # noqa: PLC0415 (after host_memory.apply() in __main__: threads start later)
  import numpy as np  # noqa: PLC0415 (after host_memory.apply() in __main__: threads start later)
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415 (after host_memory.apply() in __main__: threads start later)

  def make(kind: str, local_elems: int, n_coll: int):
    """MANY buffers; the first ``n_coll`` go through the collective, the rest through local work."""
    def step(i, carry):
      xs, m = carry
      if burst_dim:
        # compute burst; its result feeds the payloads (x + 0*m) so the collectives wait for it
        m = jnp.tanh(m @ m) * 0.5
        xs = tuple(x + 0.0 * m[0, 0] for x in xs)
      done = collective_bench.issue(kind, xs[:n_coll], [local_elems] * n_coll)
      return done + tuple(x * 0.5 + 1.0 for x in xs[n_coll:]), m

    def body(*vs):
      m0 = jnp.full((max(1, burst_dim),) * 2, 0.01, jnp.float32) + jax.lax.axis_index("x").astype(jnp.float32)
      return jax.lax.fori_loop(0, k, step, (vs, m0))[0]
    spec = (P("x"),) * MANY
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

  out = {}
  for kind in kinds:
    pts = []
    for size in SIZES:
      local = collective_bench.local_elems(kind, size)
      xs = [jax.device_put(np.ones((2 * local,), np.float32), NamedSharding(mesh, P("x"))) for _ in range(MANY)]
      # one collective, none, MANY issued together
      one_s, none_s, many_s = bench.time_interleaved([make(kind, local, n) for n in (1, 0, MANY)], xs, reps)
      pts.append([float(size), max(one_s - none_s, 1e-7) / k, one_s / k, none_s / k,
                  max(many_s - one_s, 1e-7) / k / (MANY - 1)])
    out[kind] = pts
  if pid == 0:
    print("@@" + json.dumps(out))


REPLAY_MAX_BURST_S = 0.25  # longer compute before a call is replayed as this much (the call's cost has levelled off)


def _replay_child(coord: str, pid: int, spec_path: str) -> None:
  """Times each call of ``spec_path`` (a JSON list of {kind, sizes, burst_s}) as it runs in the program:
  the buffers written by a compute burst as long as the compute before it, then issued together."""
  mesh = _init_child(coord, pid)
  import jax  # noqa: PLC0415 (after host_memory.apply() in __main__: threads start later)
  import jax.numpy as jnp  # noqa: PLC0415 (after host_memory.apply() in __main__: threads start later)
  import numpy as np  # noqa: PLC0415 (after host_memory.apply() in __main__: threads start later)
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415 (after host_memory.apply() in __main__: threads start later)
  with open(spec_path) as f:
    spec = json.load(f)

  def make(kind, locals_, iters, real):
    def body(*vs):
      m = jnp.full((BURST_DIM, BURST_DIM), 0.01, jnp.float32) + jax.lax.axis_index("x").astype(jnp.float32)
      m = jax.lax.fori_loop(0, iters, lambda i, m: jnp.tanh(m @ m) * 0.5, m)
      vs = tuple(v + 0.0 * m[0, 0] for v in vs)  # the payload is written after the compute, as in a step
      return collective_bench.issue(kind, vs, locals_) if real else tuple(v * 0.5 for v in vs)
    sp = (P("x"),) * len(locals_)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=sp, out_specs=sp, check_vma=False))

  # seconds per burst iteration on this core
  probe = make("all-reduce", [1], 40, False)
  xs1 = [jax.device_put(np.ones((2,), np.float32), NamedSharding(mesh, P("x")))]
  jax.block_until_ready(probe(*xs1))
  t0 = time.perf_counter()
  jax.block_until_ready(probe(*xs1))
  per_iter = (time.perf_counter() - t0) / 40
  out = []
  for call in spec:
    kind = call["kind"]
    locals_ = [collective_bench.local_elems(kind, s_) for s_ in call["sizes"]]
    xs = [jax.device_put(np.ones((2 * n,), np.float32), NamedSharding(mesh, P("x"))) for n in locals_]
    iters = max(1, int(round(min(call["burst_s"], REPLAY_MAX_BURST_S) / per_iter)))
    with_s, without_s = bench.time_interleaved([make(kind, locals_, iters, real) for real in (True, False)], xs,
                                             call.get("reps", 5))
    out.append(max(with_s - without_s, 1e-7))
  print("@@" + json.dumps({"seconds": out, "burst_iter_s": per_iter}))  # each process's; the parent keeps both


def replay(calls, reps: int = 5, timeout_s: float = 600.0, per_process: bool = False):
  """Measures the given calls ({kind, sizes, burst_s}) between 2 real processes over gloo, each as the program
  issues it (one combined call of all its buffers, after compute as long as the program's before it, capped at
  ``REPLAY_MAX_BURST_S``). Returns ``{perfmodel.cost.collectives.call_key(kind, sizes): seconds}`` for
  ``HardwareProfile.collective_calls``. The faithful choice when the target is this host's own 2-rank gloo
  job: no curve, no interpolation between sizes, no model of how a tuple's buffers add up.
  ``per_process``: also return ``{key: [process 0's seconds, process 1's]}``."""
  calls = list(calls)
  if not calls:
    return ({}, {}) if per_process else {}
  cores = localrun.machine_cores()  # the emulator itself may be pinned to one core
  if len(cores) < 2:
    raise RuntimeError("replaying collectives needs 2 cores (one per process)")
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump([dict(c, reps=reps) for c in calls], f)
    spec_path = f.name
  try:
    coord = f"127.0.0.1:{free_port()}"
    cmds = [localrun.python("-m", "perfmodel.emulate.gloo_calibration", "--replay", coord, str(i), spec_path)
            for i in range(2)]
    done = localrun.run_pinned(cmds, cores[:2], timeout_s=timeout_s)
  finally:
    os.unlink(spec_path)
  if done.rc != [0, 0]:
    raise RuntimeError(f"collective replay failed rc={done.rc}: {done.stderr[0][-3000:]}{done.stderr[1][-2000:]}")
  per_proc = [json.loads([l for l in out.splitlines() if l.startswith("@@")][0][2:])["seconds"]
              for out in done.stdout]
  # The process whose compute finished first also waits for the other one inside the call; the one that arrives
  # last sees the transfer alone. The table keeps that (the min over the two); the wait is the emulator's to
  # add (timeline.add_call_waits, from ``per_process``).
  both = {collectives.call_key(c["kind"], c["sizes"]): list(ts) for c, ts in zip(calls, zip(*per_proc))}
  table = {k: min(ts) for k, ts in both.items()}
  return (table, both) if per_process else table


def merge_partial(res: dict, old: Optional[dict], kinds) -> dict:
  """A calibration of some ``kinds`` merged into the previous file ``old`` (None: nothing to keep): the other kinds'
  curves stay, and each kind keeps the source of the run that measured it (``source_by_kind``), flat."""
  if old is None:
    res["source_by_kind"] = {k_: res["source"] for k_ in res["curves"]}
    return res
  for key in ("curves", "next_curves", "raw_with_collective_s", "raw_local_only_s"):
    res[key] = {**{k_: v for k_, v in old.get(key, {}).items() if k_ not in kinds}, **res[key]}
  prev = old.get("source_by_kind") or {k_: old.get("source", "?") for k_ in old.get("curves", {})}
  res["source_by_kind"] = {**{k_: v for k_, v in prev.items() if k_ not in kinds}, **{k_: res["source"] for k_ in kinds}}
  res["source"] += f" (kinds {', '.join(kinds)}; each other kind's source in source_by_kind)"
  return res


def calibrate(path: Optional[str] = None, reps: int = 7, k: int = 8, timeout_s: float = 600.0,
              burst_dim: int = BURST_DIM, kinds: tuple = KINDS) -> dict:
  """Measures the curves of ``kinds`` and writes them to ``path`` (default :func:`user_path`). Kinds not measured
  keep the curves in effect before (``path``'s, else :func:`current_path`'s), so a quick re-measure of the kinds one
  program uses leaves the others as they were."""
  path = path or user_path()
  unknown = set(kinds) - set(KINDS)
  if unknown or not kinds:
    raise ValueError(f"gloo calibration: unknown collective kinds {sorted(unknown)}; known: {KINDS}")
  cores = localrun.cores()
  if len(cores) < 2:
    raise RuntimeError("gloo calibration needs 2 cores (one per process)")
  coord = f"127.0.0.1:{free_port()}"
  load0 = os.getloadavg()[0]
  cmds = [localrun.python("-m", "perfmodel.emulate.gloo_calibration", "--child", coord, str(i), str(reps), str(k),
                          str(burst_dim), ",".join(kinds)) for i in range(2)]
  done = localrun.run_pinned(cmds, cores[:2], timeout_s=timeout_s)
  if done.rc != [0, 0]:
    raise RuntimeError(f"gloo calibration failed rc={done.rc}: {done.stderr[0][-3000:]}{done.stderr[1][-2000:]}")
  raw = json.loads([l for l in done.stdout[0].splitlines() if l.startswith("@@")][0][2:])
  res = {"curves": {k_: [[p[0], p[1]] for p in v] for k_, v in raw.items()},
         "next_curves": {k_: [[p[0], p[4]] for p in v] for k_, v in raw.items()},
         "raw_with_collective_s": {k_: [[p[0], p[2]] for p in v] for k_, v in raw.items()},
         "raw_local_only_s": {k_: [[p[0], p[3]] for p in v] for k_, v in raw.items()},
         "source": (f"python -m perfmodel.emulate.gloo_calibration on {platform.machine()} {os.cpu_count()}-core host "
                    f"{datetime.datetime.now().isoformat(timespec='minutes')}: 2 processes pinned one per core, "
                    f"jax.distributed + gloo over 127.0.0.1, shard_map over 2 devices, {k} collectives per jit call, "
                    f"each after a {burst_dim}^3 matmul burst, minus the same loop without the collective "
                    f"(next_curves: {MANY} buffers issued together, minus one, per further buffer), "
                    f"median of {reps}"),
         "burst_dim": burst_dim,
         "n": 2, "load_avg_1m": [load0, os.getloadavg()[0]], "wall_s": done.wall_s}
  old, before = None, path if os.path.exists(path) else current_path()
  if set(kinds) != set(KINDS) and os.path.exists(before):
    with open(before) as f:
      old = json.load(f)
  res = merge_partial(res, old, kinds)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(res, f, indent=1)
  return res


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m perfmodel.emulate.gloo_calibration",
                               description="measure this host's 2-process gloo collective curves (~1 min)")
  ap.add_argument("--out", default=None, help=f"write the curves here (default {user_path()}, which emulation reads)")
  ap.add_argument("--commit", action="store_true", help=f"write the committed {os.path.relpath(DEFAULT_PATH)}")
  ap.add_argument("--reps", type=int, default=7)
  a = ap.parse_args(argv)
  if a.commit and a.out:
    ap.error("--commit and --out name two destinations: pass one")
  r = calibrate(DEFAULT_PATH if a.commit else a.out, reps=a.reps)
  print(json.dumps({"curves": r["curves"], "next_curves": r["next_curves"], "load_avg_1m": r["load_avg_1m"],
                    "wall_s": r["wall_s"], "path": DEFAULT_PATH if a.commit else (a.out or user_path())}))
  return 0


if __name__ == "__main__":
  from framework import host_memory
  host_memory.apply()  # the real job's allocator regime (experiments.run applies it too)
  if len(sys.argv) > 1 and sys.argv[1] == "--replay":
    _replay_child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
  elif len(sys.argv) > 1 and sys.argv[1] == "--child":
    _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
           int(sys.argv[6]) if len(sys.argv) > 6 else 0,
           tuple(sys.argv[7].split(",")) if len(sys.argv) > 7 else KINDS)
  else:
    sys.exit(main(sys.argv[1:]))
