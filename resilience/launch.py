"""Local launcher: N node agents + S spare agents on localhost, the controller in this process.

``run_hotswap(cfg, workdir)`` is what ``python -m experiments.run --config experiments/configs/hotswap.py``
dispatches to. On a cluster the same agent (``python -m resilience.agent``) is started once per host by
SLURM / mpirun / Kubernetes and pointed at the controller's address; only this launcher is local.

Nothing is lost when this process dies, however it dies:
* agents get SIGTERM when it exits (PR_SET_PDEATHSIG; remote agents: controller silent for
  ``controller_timeout_s``) and unlink their shared memory, kill their zygote and worker, and exit;
* the workdir is locked for the run (``framework.workdir``: ``<workdir>/.prismllm.lock``, flock; the agents
  inherit it, so it is free only when the last of them is gone): a second run in the same workdir is refused
  at once while the launcher lives, and waits for the agents of a launcher that is gone;
* a rerun first removes what a SIGKILLed run of this workdir could not (its ``/dev/shm`` segments, found
  by the run ids in ``<workdir>/run_id``; never another workdir's) and resumes from the newest
  persistent checkpoint (``persist_every``).

  python -m resilience.launch --config experiments/configs/hotswap.py[:arg] --workdir DIR [--config.x=y ...]
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid

from framework import checkpoint as ckpt_lib
from framework import config as config_lib
from framework import config_file
from framework import workdir as workdir_lib
from framework.stop import Stopped
from resilience import settings as settings_lib
from resilience import slots as slots_lib
from resilience.controller import Controller
from resilience.recovery import RunFailed

log = logging.getLogger("prismllm.resilience")
LOCK_WAIT_S = 20.0  # a killed run's agents need a moment to clean up and exit


def lock_workdir(workdir: str) -> workdir_lib.Lock:
  """The workdir lock (``framework.workdir``) for this run, inheritable: agents hold it too. Raises WorkdirError
  if another run holds it; waits up to LOCK_WAIT_S for the agents of a launcher that is gone to exit."""
  return workdir_lib.lock(workdir, "hot-swap run", inheritable=True, wait_for_dead_holder_s=LOCK_WAIT_S)


def sweep_stale(workdir: str) -> list:
  """Shared-memory segments of earlier runs of *this* workdir (under its lock, so none is alive): the run ids
  are in <workdir>/run_id. Returns the removed paths."""
  removed = []
  try:
    with open(os.path.join(workdir, "run_id")) as f:
      old = [x.strip() for x in f if x.strip()]
  except OSError:
    old = []
  for rid in old:
    if not rid.isalnum():  # never glob with a pattern someone wrote into the file
      continue
    for p in glob.glob(os.path.join(slots_lib.shm_dir(), f"prismllm-{rid}-*")):
      try:
        os.unlink(p)
        removed.append(p)
      except OSError:
        pass
  return removed


def _unlink_run(run_id: str) -> None:
  for p in glob.glob(os.path.join(slots_lib.shm_dir(), f"prismllm-{run_id}-*")):
    try:
      os.unlink(p)
    except OSError:
      pass


def _on_hup(signum, _frame):  # SIGHUP: unwind through `finally` (agents, shared memory)
  raise SystemExit(128 + signum)


MODEL_SHAPE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings",
                    "scan_layers", "param_dtype")


def check_resume(workdir: str, cfg_dict: dict) -> None:
  """A rerun whose model differs (in what shapes the checkpointed state) from the one that wrote the workdir's
  checkpoints is refused before config.json is replaced (the workers would refuse the checkpoint later)."""
  step = ckpt_lib.latest_usable_step(ckpt_lib.checkpoint_dir(workdir))
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      old = json.load(f)["config"]["model"]
  except (OSError, ValueError, KeyError, TypeError):
    return  # nothing to compare with: the workers verify the checkpoint against the state they build
  new = cfg_dict["model"]
  diff = [k for k in MODEL_SHAPE_KEYS if k in old and str(old.get(k)) != str(new.get(k))]
  if step is not None and diff:
    k = diff[0]
    raise ckpt_lib.CheckpointError(
        f"checkpoint step {step} in {ckpt_lib.checkpoint_dir(workdir)} was written by another model: model.{k} was "
        f"{old[k]!r}, this config has {new[k]!r}. Resume with the config that wrote it, or use a fresh --workdir",
        kind="foreign", step=step)


def run_hotswap(cfg: config_lib.Config, workdir: str) -> dict:
  """Trains ``cfg`` with nodes + spares on localhost, surviving the configured failures. Returns a summary.

  SIGINT / SIGTERM: the controller forwards the stop to the workers, which save a checkpoint at a step they
  agree on; then :class:`framework.stop.Stopped` is raised (a second signal ends everything at once)."""
  s = settings_lib.from_config(cfg)
  workdir = workdir_lib.check_path(workdir)
  cfg_dict = config_lib.to_dict(cfg)
  cfg_dict.pop("extras", None)  # workers get the typed settings separately
  # fail fast here (not in N workers) on a mesh / batch that cannot run on `nodes` single-device processes
  config_lib.validate(config_lib.from_dict(cfg_dict), s.nodes, s.nodes)
  lock = lock_workdir(workdir)
  old_handlers = {}
  try:
    check_resume(workdir, cfg_dict)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump({"config": cfg_dict, "resilience": settings_lib.to_dict(s)}, f, indent=1, default=str)
    swept = sweep_stale(workdir)
    if swept:
      log.info("removed %d shared-memory segment(s) left by an earlier run of %s", len(swept), workdir)
    run_id = uuid.uuid4().hex[:10]
    with open(os.path.join(workdir, "run_id"), "w") as f:  # the next run (or a supervisor) cleans up after a SIGKILL
      f.write(run_id + "\n")
    ctl = Controller(cfg_dict, cfg.train.steps, s, workdir, run_id, lock_fd=lock.fd)
    if threading.current_thread() is threading.main_thread():
      old_handlers = {signal.SIGHUP: signal.signal(signal.SIGHUP, _on_hup)}
      old_handlers.update({sig: signal.signal(sig, ctl.on_stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)})
    t0 = time.time()
    try:
      out = ctl.run()
    finally:
      ctl.close()
      _unlink_run(run_id)
  finally:
    for sig, h in old_handlers.items():
      signal.signal(sig, h)
    lock.release()
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
  try:
    cfg = config_file.load(args.config, overrides)
    out = run_hotswap(cfg, args.workdir)
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  except RunFailed as e:
    print(f"hot-swap run failed: {e}", file=sys.stderr)
    return 4
  except ckpt_lib.CheckpointError as e:
    print(f"checkpoint error: {e}", file=sys.stderr)
    return 3
  except workdir_lib.WorkdirError as e:
    print(f"workdir error: {e}", file=sys.stderr)
    return 5
  except Stopped as e:
    print(str(e), file=sys.stderr)
    return e.exit_code
  print(json.dumps(out, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
