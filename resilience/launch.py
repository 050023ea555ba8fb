"""Local launcher: N node agents + S spare agents on localhost, the controller in this process.

``run_hotswap(cfg, workdir)`` is what ``python -m experiments.run --config experiments/configs/hotswap.py``
dispatches to. On a cluster the same agent (``python -m resilience.agent``) is started once per host by
SLURM / mpirun / Kubernetes and pointed at the controller's address; only this launcher is local.

Every child is started with PR_SET_PDEATHSIG=SIGKILL (agents die with the launcher, workers with
their agent) and is SIGKILLed in ``finally``; shared-memory files of the run are unlinked.

  python -m resilience.launch --config experiments/configs/hotswap.py[:arg] --workdir DIR [--config.x=y ...]
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import time
import uuid

from framework import config as config_lib
from framework import config_file
from resilience import settings as settings_lib
from resilience import slots as slots_lib
from resilience.controller import Controller

log = logging.getLogger("prismllm.resilience")


def run_hotswap(cfg: config_lib.Config, workdir: str) -> dict:
  """Trains ``cfg`` with nodes + spares on localhost, surviving the configured failures. Returns a summary."""
  s = settings_lib.from_config(cfg)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  cfg_dict = config_lib.to_dict(cfg)
  cfg_dict.pop("extras", None)  # workers get the typed settings separately
  # fail fast here (not in N workers) on a mesh / batch that cannot run on `nodes` single-device processes
  config_lib.validate(config_lib.from_dict(cfg_dict), s.nodes, s.nodes)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"config": cfg_dict, "resilience": settings_lib.to_dict(s)}, f, indent=1, default=str)
  run_id = uuid.uuid4().hex[:10]
  with open(os.path.join(workdir, "run_id"), "w") as f:  # lets a supervisor that SIGKILLs us clean /dev/shm
    f.write(run_id)
  ctl = Controller(cfg_dict, cfg.train.steps, s, workdir, run_id)
  t0 = time.time()
  try:
    out = ctl.run()
  finally:
    ctl.close()
    for p in glob.glob(os.path.join(slots_lib.shm_dir(), f"prismllm-{run_id}-*")):
      try:
        os.unlink(p)
      except OSError:
        pass
  out["wall_s"] = time.time() - t0
  with open(os.path.join(workdir, "hotswap_summary.json"), "w") as f:
    json.dump(out, f, indent=1, default=str)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m resilience.launch")
  ap.add_argument("--config", required=True)
  ap.add_argument("--workdir", required=True)
  args, overrides = ap.parse_known_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
  cfg = config_file.load(args.config, overrides)
  out = run_hotswap(cfg, args.workdir)
  print(json.dumps(out, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
