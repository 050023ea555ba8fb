"""The published rows' target-compiled programs, committed so their validation re-prices without compiling.

A TPU row's compile takes minutes on a shared 2-core host (the code generation after XLA's optimisation passes);
pricing its program takes a fraction of a second. ``validate --published --save-programs`` writes each row's program
(the optimised HLO text, the compiler's memory and the devices' placement: what :func:`perfmodel.predict.predict`
reads) to ``benchmarks/data/published_programs/<row id>.json.xz`` (LZMA), with its provenance: the overrides it was
compiled from, their config fingerprint (:func:`fingerprint`), the commit, the jax / libtpu / CUDA-plugin versions and
the digest of the framework and parallelism sources (the program builder's code version).

``validate --published --reprice`` prices every row's committed program in this process from the overrides it was
compiled from, and says whether it is fresh (:func:`freshness`): a program whose config is not the row's current
mapping, or whose builder code or compiler versions are not this checkout's, is ``stale`` with the reasons
(``--strict`` refuses it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
import os
import subprocess
import time

from framework import config as config_lib
from perfmodel import predict, program, target
from perfmodel.calib import published as P
from perfmodel.calib import published_mapping as M
from perfmodel.calib import store
from perfmodel.cost import collectives

DIR = os.path.join(P.ROOT, "benchmarks", "data", "published_programs")


def fingerprint(cfg, hardware: str, topology) -> str:
  """What the compiled step depends on in the config (as the compile cache's key), the hardware and topology."""
  d = config_lib.to_dict(cfg)
  for section in ("name", "checkpoint", "train"):
    d.pop(section, None)
  d["data"] = {k: d["data"][k] for k in ("seq_len", "global_batch")}
  # keys at their default are left out, so a key added to Config (off by default) leaves every fingerprint as it was
  default = config_lib.to_dict(config_lib.Config())
  d = {sec: {k: v for k, v in keys.items() if default.get(sec, {}).get(k, object()) != v}
       if isinstance(keys, dict) else keys for sec, keys in d.items()}
  blob = json.dumps({"cfg": d, "hw": hardware, "topology": topology}, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:20]


def code_version() -> dict:
  return {"sources": target._source_digest(), "versions": target._versions()}  # noqa: SLF001 - the cache's own


def _commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=P.ROOT, capture_output=True, text=True,
                          timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def path_of(row_id: str, folder: str = DIR) -> str:
  return os.path.join(folder, f"{row_id}.json.xz")


def export(r: P.PublishedRun, m: M.RowMapping, folder: str = DIR) -> str:
  """Copies the row's program from the compile cache into ``folder``; returns the path. Raises FileNotFoundError
  when the cache holds no program of this config (compiled under other sources, or never compiled)."""
  cfg = M.build_config(m.overrides, r.n_chips)
  cache = os.path.join(target.cache_dir(), target.key(cfg, r.hardware, m.topology, m.framework) + ".json.gz")
  cap = target._load(cache)  # noqa: SLF001 - the cache's own reader
  if cap is None:
    raise FileNotFoundError(f"program not saved: no compiled program of row {r.id}'s config in {cache}")
  d = {f.name: getattr(cap, f.name) for f in dataclasses.fields(cap) if f.name not in ("compiled", "route_detail")}
  d["placement"] = dataclasses.asdict(cap.placement) if cap.placement is not None else None
  d["provenance"] = {"row": r.id, "hardware": r.hardware, "topology": m.topology, "overrides": m.overrides,
                     "framework": m.framework,
                     "config_fingerprint": fingerprint(cfg, r.hardware, m.topology), "commit": _commit(),
                     **code_version(), "saved": time.strftime("%Y-%m-%d")}
  out = path_of(r.id, folder)
  store.write_bytes(out, lzma.compress(json.dumps(d).encode(), preset=9))
  return out


def load(row_id: str, folder: str = DIR) -> tuple:
  """(program.Captured, provenance) of a committed program; FileNotFoundError when there is none."""
  path = path_of(row_id, folder)
  if not os.path.exists(path):
    raise FileNotFoundError(f"no committed program {os.path.relpath(path, P.ROOT)}")
  with open(path, "rb") as f:
    d = json.loads(lzma.decompress(f.read()))
  prov, pl = d.pop("provenance"), d.pop("placement")
  placement = collectives.Placement(tuple(tuple(c) for c in pl["coords"]), tuple(pl["shape"]), tuple(pl["wrap"]))
  cap = program.Captured(placement=placement, route_detail=f"committed program {os.path.relpath(path, P.ROOT)}", **d)
  return cap, prov


def _as_dict(overrides: list) -> dict:
  return dict(o[len("--config."):].split("=", 1) for o in overrides if not o.startswith("--config.name="))


def freshness(r: P.PublishedRun, m: M.RowMapping, prov: dict) -> list:
  """Why the committed program is not the row's current one ([] = fresh): its config is not the current mapping's,
  or its builder sources / compiler versions are not this checkout's."""
  reasons = []
  recorded = M.build_config(prov["overrides"], r.n_chips)
  fp = prov.get("config_fingerprint") or fingerprint(recorded, r.hardware, prov.get("topology"))
  if m.error:
    reasons.append(f"mapping: the row's current mapping does not build in this checkout ({m.error})")
  elif fingerprint(M.build_config(m.overrides, r.n_chips), r.hardware, m.topology) != fp:
    old, new = _as_dict(prov["overrides"]), _as_dict(m.overrides)
    diff = [f"{k}: {old.get(k, '-')} -> {new.get(k, '-')}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    reasons.append("mapping: compiled from another config (" + ("; ".join(diff) or "base config changed") + ")")
  if not m.error and prov.get("framework") != m.framework:
    reasons.append(f"mapping: priced as framework {prov.get('framework')!r}, the mapping now says {m.framework!r}")
  now = code_version()
  if prov.get("sources") != now["sources"]:
    reasons.append(f"code: built from framework / parallelism sources {prov.get('sources')}, this checkout's are "
                   f"{now['sources']}")
  if prov.get("versions") != now["versions"]:
    changed = sorted(k for k in now["versions"] if (prov.get("versions") or {}).get(k) != now["versions"][k])
    reasons.append(f"code: compiled with other versions of {', '.join(changed)}")
  return reasons


def reprice(r: P.PublishedRun, m: M.RowMapping, backend: str = "auto", folder: str = DIR) -> dict:
  """The row's Prediction (as JSON) from its committed program, priced in this process with the config it was
  compiled from, with ``stale_reasons``; or {'error': ...} without a program."""
  try:
    cap, prov = load(r.id, folder)
  except FileNotFoundError as e:
    return {"error": m.error or str(e)}  # a row whose mapping does not build has no program: its reason is the error
  t0 = time.perf_counter()
  p = predict.predict(M.build_config(prov["overrides"], r.n_chips), r.hardware, backend=backend, captured=cap,
                      method="target_compile", framework=prov.get("framework"))
  out = p.to_dict()
  out["price_s"] = time.perf_counter() - t0
  out["program_overrides"] = prov["overrides"]
  out["stale_reasons"] = freshness(r, m, prov)
  return out
