"""The published rows' target-compiled programs, committed so their validation re-prices without compiling.

A TPU row's compile takes minutes on a shared 2-core host (the code generation after XLA's optimisation passes);
pricing its program takes seconds. ``validate --published --save-programs`` writes each row's program (the
optimised HLO text, the compiler's memory and the devices' placement: what :func:`perfmodel.predict.predict` reads)
to ``benchmarks/data/published_programs/<row id>.json.xz`` (LZMA: 20-90 KB a row, ~5x smaller than gzip), with its
provenance: the commit, the jax / libtpu / CUDA-plugin versions and the digest of the framework and parallelism
sources it was compiled from. ``validate --published --reprice`` predicts every row from these files in this
process. A program compiled from other sources than the checkout's is still used, and flagged ``stale`` in the row
(the model changed since: recompile with ``validate --published`` to refresh).
"""
from __future__ import annotations

import dataclasses
import json
import lzma
import os
import subprocess
import time

from framework import config as config_lib
from framework import config_file
from perfmodel import predict, program, target
from perfmodel.calib import published as P
from perfmodel.calib import store
from perfmodel.cost import collectives

DIR = os.path.join(P.ROOT, "benchmarks", "data", "published_programs")


def row_cfg(r: P.PublishedRun, overrides: list):
  """The config the predict child builds for the row: the base config file with the row's overrides."""
  cfg = config_file.load(os.path.join(P.ROOT, P.BASE_CONFIG), overrides)
  return config_lib.validate(cfg, r.n_chips)


def _commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=P.ROOT, capture_output=True, text=True,
                          timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def export(r: P.PublishedRun, overrides: list, topology, folder: str = DIR) -> str:
  """Copies the row's program from the compile cache into ``folder``; returns the path ('' if not cached)."""
  cfg = row_cfg(r, overrides)
  path = os.path.join(target.cache_dir(), target.key(cfg, r.hardware, topology) + ".json.gz")
  cap = target._load(path)  # noqa: SLF001 - the cache's own reader
  if cap is None:
    return ""
  d = {f.name: getattr(cap, f.name) for f in dataclasses.fields(cap) if f.name not in ("compiled", "route_detail")}
  d["placement"] = dataclasses.asdict(cap.placement) if cap.placement is not None else None
  d["provenance"] = {"row": r.id, "hardware": r.hardware, "topology": topology, "overrides": overrides,
                     "commit": _commit(), "versions": target._versions(), "sources": target._source_digest(),  # noqa: SLF001
                     "saved": time.strftime("%Y-%m-%d")}
  out = os.path.join(folder, f"{r.id}.json.xz")
  store.write_bytes(out, lzma.compress(json.dumps(d).encode(), preset=9))
  return out


def reprice(r: P.PublishedRun, overrides: list, backend: str = "auto", folder: str = DIR) -> dict:
  """The row's Prediction (as JSON) from its committed program, priced in this process, or {'error': ...}."""
  path = os.path.join(folder, f"{r.id}.json.xz")
  if not os.path.exists(path):
    return {"error": f"no committed program {path}: run validate --published --save-programs"}
  with open(path, "rb") as f:
    d = json.loads(lzma.decompress(f.read()))
  prov = d.pop("provenance")
  pl = d.pop("placement")
  placement = collectives.Placement(tuple(tuple(c) for c in pl["coords"]), tuple(pl["shape"]), tuple(pl["wrap"]))
  cap = program.Captured(placement=placement, route_detail=f"committed program {os.path.relpath(path, P.ROOT)}", **d)
  t0 = time.perf_counter()
  p = predict.predict(row_cfg(r, overrides), r.hardware, backend=backend, captured=cap, method="target_compile")
  out = p.to_dict()
  out["child_wall_s"] = time.perf_counter() - t0
  out["provenance"] = prov
  out["stale"] = prov.get("sources") != target._source_digest()  # noqa: SLF001
  return out
