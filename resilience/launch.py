"""Local launcher: N node agents + S spare agents on localhost, the controller in this process.

``run_hotswap(cfg, workdir)`` is what ``python -m experiments.run --config experiments/configs/hotswap.py``
dispatches to. On a cluster the same agent (``python -m resilience.agent``) is started once per host by
SLURM / mpirun / Kubernetes and pointed at the controller's address; only this launcher is local.

Nothing is lost when this process dies, however it dies:
* agents get SIGTERM when it exits (PR_SET_PDEATHSIG; remote agents: controller silent for
  ``controller_timeout_s``) and unlink their shared memory, kill their zygote and worker, and exit;
* the workdir is locked for the run (``<workdir>/.hotswap.lock``, flock; the agents inherit it, so it is
  free only when the last of them is gone): a second run in the same workdir waits for it, or says why not;
* a rerun first removes what a SIGKILLed run of this workdir could not (its ``/dev/shm`` segments, found
  by the run ids in ``<workdir>/run_id``; never another workdir's) and resumes from the newest
  persistent checkpoint (``persist_every``).

  python -m resilience.launch --config experiments/configs/hotswap.py[:arg] --workdir DIR [--config.x=y ...]
"""
from __future__ import annotations

import argparse
import fcntl
import glob
import json
import logging
import os
import signal
import sys
import time
import uuid

from framework import config as config_lib
from framework import config_file
from resilience import settings as settings_lib
from resilience import slots as slots_lib
from resilience.controller import Controller
from resilience.recovery import RunFailed

log = logging.getLogger("prismllm.resilience")
LOCK_WAIT_S = 20.0  # a killed run's agents need a moment to clean up and exit


def lock_workdir(workdir: str) -> int:
  """Exclusive lock on the workdir for this run (inheritable fd: agents hold it too). Raises RunFailed if
  another run still holds it after LOCK_WAIT_S."""
  path = os.path.join(workdir, ".hotswap.lock")
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  end = time.time() + LOCK_WAIT_S
  while True:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      break
    except BlockingIOError:
      if time.time() > end:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RunFailed(f"workdir {workdir} is in use by another hot-swap run (launcher pid {holder}): wait for "
                        f"it to finish, stop it, or use another --workdir") from None
      time.sleep(0.2)
  os.ftruncate(fd, 0)
  os.pwrite(fd, str(os.getpid()).encode(), 0)
  os.set_inheritable(fd, True)
  return fd


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


def _on_term(signum, _frame):  # SIGTERM / SIGHUP: unwind through `finally` (agents, shared memory)
  raise SystemExit(128 + signum)


def run_hotswap(cfg: config_lib.Config, workdir: str) -> dict:
  """Trains ``cfg`` with nodes + spares on localhost, surviving the configured failures. Returns a summary."""
  s = settings_lib.from_config(cfg)
  workdir = os.path.abspath(workdir)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise RunFailed(f"--workdir {workdir} exists and is not a directory: pass a directory")
  os.makedirs(workdir, exist_ok=True)
  cfg_dict = config_lib.to_dict(cfg)
  cfg_dict.pop("extras", None)  # workers get the typed settings separately
  # fail fast here (not in N workers) on a mesh / batch that cannot run on `nodes` single-device processes
  config_lib.validate(config_lib.from_dict(cfg_dict), s.nodes, s.nodes)
  lock_fd = lock_workdir(workdir)
  old_handlers = {}
  try:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump({"config": cfg_dict, "resilience": settings_lib.to_dict(s)}, f, indent=1, default=str)
    import threading  # noqa: PLC0415
    if threading.current_thread() is threading.main_thread():
      old_handlers = {sig: signal.signal(sig, _on_term) for sig in (signal.SIGTERM, signal.SIGHUP)}
    swept = sweep_stale(workdir)
    if swept:
      log.info("removed %d shared-memory segment(s) left by an earlier run of %s", len(swept), workdir)
    run_id = uuid.uuid4().hex[:10]
    with open(os.path.join(workdir, "run_id"), "w") as f:  # the next run (or a supervisor) cleans up after a SIGKILL
      f.write(run_id + "\n")
    ctl = Controller(cfg_dict, cfg.train.steps, s, workdir, run_id, lock_fd=lock_fd)
    t0 = time.time()
    try:
      out = ctl.run()
    finally:
      ctl.close()
      _unlink_run(run_id)
  finally:
    for sig, h in old_handlers.items():
      signal.signal(sig, h)
    os.close(lock_fd)
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
  print(json.dumps(out, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
