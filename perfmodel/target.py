"""The training step compiled for the target (TPU / GPU compile-only devices), cached by what determines it.

:func:`train_step` returns :func:`perfmodel.program.target_train_step`'s capture, read from
``$PRISMLLM_CACHE/programs/`` when the same program was compiled before: the key hashes the config (every field
that reaches the program), the hardware and topology, the versions of jax, jaxlib, libtpu and the CUDA plugin, and
this repository's model, parallelism and framework sources, so a change to any of them compiles afresh. An entry is
the optimised HLO text (gzip) and the compiler's memory and timings; re-pricing a cached program parses its text
(seconds) instead of compiling it (minutes for a TPU target on a shared 2-core host).
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.metadata
import json
import os
import tempfile
from typing import Optional

from framework import config as config_lib
from framework.config import Config
from perfmodel import program
from perfmodel.cost import collectives
from perfmodel.cost.database import CACHE_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOURCES = ("framework", "parallelism")  # the code a compiled step is made of
_PACKAGES = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax", "optax")


def cache_dir() -> str:
  return os.path.join(os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "prismllm"),
                      "programs")


def _versions() -> dict:
  out = {}
  for name in _PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _source_digest() -> str:
  h = hashlib.sha256()
  for pkg in _SOURCES:
    for dirpath, _, files in sorted(os.walk(os.path.join(ROOT, pkg))):
      for f in sorted(files):
        if f.endswith((".py", ".txtpb")):
          with open(os.path.join(dirpath, f), "rb") as fh:
            h.update(f.encode() + fh.read())
  return h.hexdigest()[:16]


def key(cfg: Config, hardware: str, topology: Optional[str] = None) -> str:
  """The cache key of ``cfg``'s step compiled for ``hardware``: what the program depends on, hashed."""
  d = config_lib.to_dict(cfg)
  d.pop("name", None)
  for section in ("checkpoint", "train"):  # never reach the compiled step
    d.pop(section, None)
  d["data"] = {k: d["data"][k] for k in ("seq_len", "global_batch")}
  blob = json.dumps({"cfg": d, "hw": hardware, "topology": topology, "versions": _versions(),
                     "sources": _source_digest()}, sort_keys=True, default=str)
  return f"{hardware}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def _load(path: str) -> Optional[program.Captured]:
  try:
    with gzip.open(path, "rt") as f:
      d = json.load(f)
  except (OSError, ValueError, EOFError):
    return None  # absent or half-written by a killed run: compile afresh
  pl = d.pop("placement")
  d["placement"] = collectives.Placement(tuple(tuple(c) for c in pl["coords"]), tuple(pl["shape"]),
                                         tuple(pl["wrap"])) if pl else None
  return program.Captured(**d)


def _store(path: str, cap: program.Captured) -> None:
  d = {f.name: getattr(cap, f.name) for f in dataclasses.fields(cap) if f.name != "compiled"}
  d["placement"] = dataclasses.asdict(cap.placement) if cap.placement is not None else None
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
  try:
    with os.fdopen(fd, "wb") as raw, gzip.open(raw, "wt") as f:
      json.dump(d, f)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def train_step(cfg: Config, hardware: str, topology: Optional[str] = None, cache: bool = True) -> program.Captured:
  """The target-compiled step of ``cfg`` (cached; ``cache=False`` always compiles and stores nothing)."""
  path = os.path.join(cache_dir(), key(cfg, hardware, topology) + ".json.gz")
  cap = _load(path) if cache else None
  if cap is not None:
    cap.route_detail = (cap.route_detail + "; " if cap.route_detail else "") + f"program read from the cache {path}"
    return cap
  cap = program.target_train_step(cfg, hardware, topology)
  if cache:
    _store(path, cap)
  return cap
