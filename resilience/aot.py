"""Ahead-of-time executables per rank: a new generation skips tracing, lowering and compiling.

The persistent compilation cache only skips XLA's compile; tracing the model and lowering still cost
seconds per process (most of a recovery on a busy host). Generation 0 serializes each rank's
compiled step (``jax.experimental.serialize_executable``) with the abstract state's shapes, dtypes
and PartitionSpecs; later generations deserialize it against the new mesh (same shape, same device
ids), so the first step after a swap runs exactly the executable the failure-free run used.
Any mismatch or error falls back to build + compile (logged): this is an accelerator, never the
source of truth.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from typing import Optional

import jax
import jaxlib
from jax.experimental import serialize_executable as ser
from jax.sharding import NamedSharding


_CODE = None


def code_fingerprint() -> str:
  """Hash of the source that builds the step (framework/, parallelism/, resilience/): an edit changes the key.
  Computed once per process, when the zygote imports the code (resilience.worker._warm)."""
  global _CODE
  if _CODE is None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for top in ("framework", "parallelism", "resilience"):
      for dirpath, dirs, files in os.walk(os.path.join(root, top)):
        dirs.sort()
        for f in sorted(files):
          if f.endswith(".py"):
            with open(os.path.join(dirpath, f), "rb") as fh:
              h.update(f.encode() + b"\0" + fh.read())
    _CODE = h.hexdigest()
  return _CODE


def key(cfg_dict: dict, n: int, extra: str = "") -> str:
  """Everything the executable depends on: config, process count, jax / jaxlib, XLA flags, the code."""
  blob = (json.dumps(cfg_dict, sort_keys=True, default=str) + f"|n={n}|jax={jax.__version__}|"
          f"jaxlib={jaxlib.__version__}|xla={os.environ.get('XLA_FLAGS', '')}|code={code_fingerprint()}|{extra}")
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def path(cache_dir: str, k: str, rank: int) -> str:
  """Next to the persistent compilation cache: a later generation, or a rerun of the same job (e.g. after the
  controller died), loads it instead of compiling."""
  return os.path.join(cache_dir, "aot", f"{k}-rank{rank}.pkl")


def save(p: str, compiled: dict, abstract_state, batch_spec) -> None:
  leaves, treedef = jax.tree.flatten(abstract_state)
  specs = [(l.shape, str(l.dtype), l.sharding.spec) for l in leaves]
  blob = {"compiled": {name: ser.serialize(c) for name, c in compiled.items() if c is not None},
          "state": (treedef, specs), "batch_spec": batch_spec}
  os.makedirs(os.path.dirname(p), exist_ok=True)
  tmp = f"{p}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    pickle.dump(blob, f)
  os.replace(tmp, p)  # atomic: a worker killed mid-write never leaves a torn file


def load(p: str, mesh) -> Optional[tuple]:
  """(compiled dict, abstract state with shardings on ``mesh``, batch PartitionSpec) or None if absent."""
  if not os.path.exists(p):
    return None
  with open(p, "rb") as f:
    blob = pickle.load(f)
  compiled = {name: ser.deserialize_and_load(*v) for name, v in blob["compiled"].items()}
  treedef, specs = blob["state"]
  leaves = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)) for shape, dtype, spec in specs]
  return compiled, jax.tree.unflatten(treedef, leaves), blob["batch_spec"]
