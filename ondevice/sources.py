"""Where exported weights come from: a training workdir (orbax checkpoint) or random init from a config."""
from __future__ import annotations

import json
import os
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
  import orbax.checkpoint as ocp
  path = os.path.join(ck, str(step), "state")
  # Restore without a target: plain (host, unsharded) arrays, so any mesh the run used is fine here.
  state = ocp.StandardCheckpointer().restore(path)
  params = state["params"] if isinstance(state, dict) else state.params
  return params, cfg, step
