"""Where exported weights come from: a training workdir (orbax checkpoint) or random init from a config."""
from __future__ import annotations

import json
import os

import numpy as np
from typing import Optional, Sequence

from framework.config import Config


def config_from_file(spec: str, overrides: Sequence[str] = ()) -> Config:
  from framework import config_file
  return config_file.load(spec, list(overrides))


def random_params(cfg: Config, seed: int = 0):
  import jax
  from framework import model as fm
  with jax.numpy_rank_promotion("allow"):
    return fm.init_params(fm.build(cfg.model), jax.random.key(seed))


def workdir_params(workdir: str, step: Optional[int] = None):
  """(params, Config) from a training workdir: ``config.json`` + orbax ``checkpoints/<step>/state``."""
  from framework import config as config_lib
  workdir = os.path.abspath(workdir)
  cfg_path = os.path.join(workdir, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{cfg_path} not found: is {workdir} a training workdir written by "
                            f"`python -m experiments.run --workdir ...`?")
  with open(cfg_path) as f:
    cfg = config_lib.from_dict(json.load(f))
  ck = os.path.join(workdir, "checkpoints")
  steps = sorted(int(d) for d in os.listdir(ck) if d.isdigit()) if os.path.isdir(ck) else []
  if not steps:
    raise FileNotFoundError(f"no checkpoint under {ck}; train with checkpoint.every > 0 or pass --random")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise FileNotFoundError(f"no checkpoint step {step} under {ck}; steps present: {steps}")
  params = _restore_params(os.path.join(ck, str(step), "state"))
  check_params_match(params, cfg, f"checkpoint step {step} in {ck}")
  return params, cfg, step


def check_params_match(params, cfg: Config, where: str) -> None:
  """Refuses weights whose shapes are not the ones ``cfg.model`` builds (a config.json that describes another
  model than its checkpoint): the GGUF header would claim one shape over weights of another."""
  import jax
  from flax.core import meta
  from framework import model as fm
  from ondevice.errors import InputError
  with jax.numpy_rank_promotion("allow"):
    want = meta.unbox(jax.eval_shape(lambda: fm.init_params(fm.build(cfg.model), jax.random.key(0))))
  shapes = lambda tree: {jax.tree_util.keystr(p): tuple(np.shape(x))  # noqa: E731
                         for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
  w, g = shapes(want), shapes(params)
  if w == g:
    return
  k = next((k for k in sorted(w) if g.get(k) != w[k]), None) or sorted(set(g) - set(w))[0]
  raise InputError(f"config.json does not describe {where}: params{k} is {g.get(k, 'absent')} there, the config's "
                   f"model needs {w.get(k, 'nothing')} (config.json was rewritten for another model); rerun the "
                   f"training command that wrote the checkpoint to restore config.json, or export from another "
                   f"--workdir")


def _restore_params(path: str):
  """Only ``params`` from an orbax train-state checkpoint, onto one host device.

  A target-less restore fails on any checkpoint written from a multi-device mesh ("Topology mismatch"),
  which is every real training run, so the target is built from the checkpoint's own metadata with a
  single-device sharding. ``partial_restore`` skips the optimizer state (2x the params in memory).
  """
  import jax
  import orbax.checkpoint as ocp
  meta = ocp.StandardCheckpointer().metadata(path).item_metadata.tree
  if "params" not in meta:
    raise FileNotFoundError(f"{path} has no 'params' entry (keys {sorted(meta)}); not a PrismLLM train state")
  host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  target = {"params": jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=host),
                                             meta["params"])}
  restore_args = jax.tree_util.tree_map(lambda _: ocp.ArrayRestoreArgs(sharding=host), target)
  with ocp.PyTreeCheckpointer() as ckptr:
    out = ckptr.restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                           partial_restore=True))
  return _unbox_saved(jax.tree_util.tree_map(np.asarray, out["params"]))


def _unbox_saved(tree):
  """Flax ``Partitioned`` boxes are saved as ``{'value': array}``; the exporter wants the bare arrays."""
  if isinstance(tree, dict):
    if set(tree) == {"value"} and isinstance(tree["value"], np.ndarray):
      return tree["value"]
    return {k: _unbox_saved(v) for k, v in tree.items()}
  return tree
