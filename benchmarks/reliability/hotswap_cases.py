"""The hot-swap cases (registered into ``resilience_area.CASES``), by class.

hotswap_controller: the controller SIGKILLed mid-run (agents clean up, a rerun resumes bit-identically), a
damaged or foreign persistent checkpoint under a rerun, a second run on a workdir in use, a workdir that is a
file; hotswap_recovery: a node dies while the job recovers from another failure; hotswap_campaign: random
failures of every kind. Results are compared with a failure-free run of the same steps and nodes.
"""
from __future__ import annotations

import os
import signal
import time

from benchmarks.reliability.harness import (committed_files, finish, losses_by_step, lost_files, run, shm_of, start,
                                            summary_json, wait_gone)
from benchmarks.reliability.resilience_area import Outcome, case, classify
from benchmarks.reliability.resilience_cases import _flip_bit
from framework import checkpoint as ckpt_lib
from resilience import injection

HS = "experiments/configs/hotswap.py:runlocal=True"



def _hs_argv(ws, workdir, steps, **res):
  opts = {"compile_cache_dir": ws.cache, "heartbeat_timeout_s": 3.0, "wall_timeout_s": 590}
  opts.update(res)
  # keep every checkpoint: the data-lost check must not mistake orbax's max_to_keep clean-up for a loss
  return ["--config", HS, "--workdir", workdir, f"--config.train.steps={steps}", "--config.checkpoint.keep=100",
          *[f"--config.extras.resilience.{k}={v}" for k, v in opts.items()]]


def _final_bytes(wd, nodes):
  out = []
  for r in range(nodes):
    with open(os.path.join(wd, "final", f"rank{r}.bin"), "rb") as f:
      out.append(f.read())
  return out


def _hs_reference(ws, steps, nodes):
  """A failure-free run: the numbers depend on the steps and the nodes only (not on spares or checkpoints)."""
  def build():
    wd = ws.fresh(f"hs_reference_{steps}_{nodes}")
    r = run(_hs_argv(ws, wd, steps, nodes=nodes, spares=0), 600, wd)
    assert r.rc == 0, r.err[-3000:]
    return {"losses": {s: v[0] for s, v in losses_by_step(wd).items()}, "final": _final_bytes(wd, nodes)}
  return ws.memo(("hs_ref", steps, nodes), build)


def _same_as_reference(ws, wd, steps, **res):
  nodes = res.get("nodes", 4)
  ref = _hs_reference(ws, steps, nodes)
  got = losses_by_step(wd)
  return set(got) == set(ref["losses"]) and all(all(x == ref["losses"][s] for x in v) for s, v in got.items()) \
      and _final_bytes(wd, nodes) == ref["final"]


SMALL = {"nodes": 2, "spares": 0, "persist_every": 3}


def _kill_controller(ws, wd, steps, min_step, **res):
  """Starts a hot-swap job, SIGKILLs its launcher once a checkpoint >= min_step is final. Returns (leftover
  processes after 40 s, leftover shared memory, committed step at the kill) or None if it finished first."""
  proc = start(_hs_argv(ws, wd, steps, **res))
  ck = ckpt_lib.checkpoint_dir(wd)
  committed = None
  end = time.time() + 500
  while proc.poll() is None and time.time() < end:
    committed = ckpt_lib.latest_usable_step(ck)
    if committed is not None and committed >= min_step:
      break
    time.sleep(0.05)
  if proc.poll() is not None or committed is None or committed < min_step:
    finish(proc, 10, wd)
    return None
  rid = open(os.path.join(wd, "run_id")).read().split()[-1]
  os.kill(proc.pid, signal.SIGKILL)  # the launcher only: agents must notice and clean up by themselves
  proc.wait()
  left = wait_gone(proc.pid, 40.0)
  shm = shm_of(wd, rid)
  finish(proc, 10, wd)
  return left, shm, committed


@case("hotswap_controller", timeout_s=900, slow=True)
def _controller_sigkill_then_rerun(ws):
  steps = 15
  wd = ws.fresh("hs_ctl_kill")
  k = _kill_controller(ws, wd, steps, 3, **SMALL)
  if k is None:
    return Outcome("silent", "the job finished before the controller could be killed (nothing was checked)")
  left, shm, committed = k
  r = run(_hs_argv(ws, wd, steps, **SMALL), 600, wd)
  o = classify(r, lambda rr: (summary_json(rr).get("resumed_from") or 0) >= committed > 0 and
               _same_as_reference(ws, wd, steps, **SMALL))
  if left or shm:
    o.data_lost, o.detail = True, f"after the controller's SIGKILL: processes {left}, shared memory {shm}; {o.detail}"
  return o


@case("hotswap_controller", timeout_s=900, slow=True)
def _corrupt_checkpoint_under_hotswap_rerun(ws):
  """Controller killed, then the newest persistent checkpoint damaged: the rerun's workers find the checksum
  mismatch, the controller moves that step aside and restarts from the one before, bit-identical."""
  steps = 15
  wd = ws.fresh("hs_corrupt_rerun")
  k = _kill_controller(ws, wd, steps, 6, **SMALL)
  if k is None:
    return Outcome("silent", "the job finished before the controller could be killed (nothing was checked)")
  newest = ckpt_lib.step_dirs(ckpt_lib.checkpoint_dir(wd))[0]
  _flip_bit(wd, newest)
  before = committed_files(wd)
  r = run(_hs_argv(ws, wd, steps, **SMALL), 600, wd)
  o = classify(r, lambda rr: os.path.isdir(os.path.join(wd, ckpt_lib.BAD_DIR, str(newest))) and
               _same_as_reference(ws, wd, steps, **SMALL))
  o.data_lost = bool(lost_files(before, wd) or k[0] or k[1])
  return o


@case("hotswap_controller", timeout_s=900, slow=True)
def _foreign_checkpoint_under_hotswap(ws):
  wd = ws.fresh("hs_foreign")
  r0 = run(_hs_argv(ws, wd, 3, **SMALL) + ["--config.model.d_model=32"], 600, wd)
  if r0.rc != 0:
    return Outcome("crash", f"could not write the other model's checkpoint: {r0.err[-300:]}")
  before = committed_files(wd)
  o = classify(run(_hs_argv(ws, wd, 6, **SMALL), 600, wd))
  o.data_lost = o.data_lost or bool(lost_files(before, wd))
  return o


@case("hotswap_controller", timeout_s=900, slow=True)
def _second_run_on_a_workdir_in_use(ws):
  wd = ws.fresh("hs_in_use")
  first = start(_hs_argv(ws, wd, 12, **SMALL))
  end = time.time() + 300
  while not os.path.exists(os.path.join(wd, "run_id")) and time.time() < end:
    time.sleep(0.1)
  o = classify(run(_hs_argv(ws, wd, 12, **SMALL), 120))
  r1 = finish(first, 600, wd)
  if r1.rc != 0 or not _same_as_reference(ws, wd, 12, **SMALL):
    o.data_lost, o.detail = True, f"the first run was harmed: rc {r1.rc}; {o.detail}"
  return o


@case("hotswap_controller", timeout_s=120)
def _workdir_is_a_file(ws):
  p = os.path.join(ws.fresh("hs_file"), "workdir")
  open(p, "w").write("not a folder")
  return classify(run(_hs_argv(ws, p, 4, **SMALL), 120))


@case("hotswap_recovery", timeout_s=900, slow=True)
def _node_dies_while_recovering(ws):
  res = {"spares": 2}
  wd = ws.fresh("hs_recovery")
  r = run(_hs_argv(ws, wd, 8, fail_at=4, fail_kind="recovery", fail_rank=0, **res), 600, wd)
  ok = lambda rr: (any(x["restarts_during_recovery"] >= 1 for x in summary_json(rr).get("recoveries", []))
                   and _same_as_reference(ws, wd, 8, **res))
  return classify(r, ok)


@case("hotswap_recovery", timeout_s=900, slow=True)
def _hang_then_node_loss_during_recovery(ws):
  """A hung worker (SIGSTOP) is fenced; while the new generation starts, another node dies."""
  res = {"spares": 3}
  wd = ws.fresh("hs_hang_recovery")
  r = run(_hs_argv(ws, wd, 10, fail_at="3,6", fail_kind="hang,recovery", fail_rank=1, **res), 600, wd)
  return classify(r, lambda rr: len(summary_json(rr).get("recoveries", [])) == 2 and
                  _same_as_reference(ws, wd, 10, **res))


@case("hotswap_campaign", timeout_s=1800, slow=True)
def _random_campaign(ws):
  steps, n = 40, 8
  camp = injection.random_campaign(n, steps, 4, 1, seed=7, kinds=["worker", "node", "replication", "hang",
                                                                   "recovery"])
  res = {"respawn_spares": True, "spares": 2}
  wd = ws.fresh("hs_campaign")
  r = run(_hs_argv(ws, wd, steps, **camp, **res, wall_timeout_s=1500), 1600, wd)
  out = summary_json(r)
  o = classify(r, lambda rr: out.get("failures_injected", 0) >= n and _same_as_reference(ws, wd, steps, **res))
  o.detail = f"{out.get('failures_injected')} failures, {len(out.get('recoveries', []))} recoveries; {o.detail}"
  return o
