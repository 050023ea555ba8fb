"""Profiled backend filler: time the unique dots of a graph on this host and store them by fingerprint.

vTrain-style: a step has few unique matmul shapes (a scanned transformer: ~10-20), each is rebuilt
from its (batch, m, n, k, dtype) as a ``lax.dot_general`` and timed on the real device. The
database file is versioned by profile name and jax version (costs.db_path) and records the device
kind and date, so a stale or foreign file is visible. Fusions other than dots are not profiled (jax
offers no HLO-text -> executable path; they stay with the calibrated backend).
"""
from __future__ import annotations

import datetime
import json
import os
import platform

from perfmodel import bench, costs
from perfmodel.graph import ExecGraph

_DT = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}


def profile_dots(g: ExecGraph, profile: str = "cpu", reps: int = 5, path: str = None) -> dict:
  import jax
  import jax.numpy as jnp
  path = path or costs.db_path(profile)
  data = {"meta": {}, "entries": {}}
  if os.path.exists(path):
    with open(path) as f:
      data = json.load(f)
  todo = {}
  for n, _ in g.walk():
    if n.kind == "dot" and n.dot is not None and n.fingerprint not in data["entries"]:
      todo[n.fingerprint] = n
  dev = jax.devices()[0]
  for fp, n in todo.items():
    d = n.dot
    dt = jnp.dtype(_DT.get(d.dtype, "float32"))
    a = jax.device_put(jnp.ones((d.batch, d.m, d.k), dt), dev)
    b = jax.device_put(jnp.ones((d.batch, d.k, d.n), dt), dev)
    fn = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((2,), (1,)), ((0,), (0,)))))
    r = bench.time_fn(fn, a, b, reps=reps, min_time=0.05)
    # The standalone jit call includes one dispatch; the in-program node does not.
    data["entries"][fp] = max(1e-7, r["median"] - _dispatch_s())
  data["meta"] = {"device_kind": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
                  "host": platform.node(), "date": datetime.date.today().isoformat(),
                  "method": "lax.dot_general rebuilt from (batch,m,n,k,dtype), median minus dispatch"}
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(data, f, indent=0, sort_keys=True)
  return {"profiled": len(todo), "db": path, "entries": len(data["entries"])}


_DISPATCH = []


def _dispatch_s() -> float:
  if not _DISPATCH:
    import jax
    import jax.numpy as jnp
    x = jnp.ones((4,), jnp.float32)
    _DISPATCH.append(bench.time_fn(jax.jit(lambda v: v + 1), x, reps=50)["median"])
  return _DISPATCH[0]
