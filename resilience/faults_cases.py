"""The resilience / checkpoint / config cases (registered into ``resilience.faults.CASES``), by class.

config: type errors, out-of-range sizes and broken config files, on the command line and in files;
checkpoint_corrupt / checkpoint_partial / checkpoint_foreign: a plain training workdir whose checkpoints were
damaged, cut short, or written by another model (a rerun must resume from the newest good step, bit-exact, or
stop with one line); checkpoint_kill: the trainer SIGKILLed while an async save writes; hotswap_controller:
the hot-swap controller SIGKILLed, a damaged or foreign checkpoint under a hot-swap rerun, a workdir in use;
hotswap_recovery: a node dies while the job recovers from another; hotswap_campaign: random failures.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import time

from framework import checkpoint as ckpt_lib
from resilience import injection
from resilience.faults import (Outcome, case, classify, committed_files, finish, lost_files, run, shm_of, start,
                               summary_json, wait_gone)

QS = "experiments/configs/quickstart.py"
HS = "experiments/configs/hotswap.py:runlocal=True"


# ------------------------------------------------------------------------------------------ config

def _cfg(ws, *argv, config=QS):
  return classify(run(["--config", config, "--workdir", ws.fresh("cfg"), *argv], 120))


def _cfg_file(ws, name, body, *argv):
  p = os.path.join(ws.fresh(name), "cfg.py")
  with open(p, "w") as f:
    f.write(body)
  return classify(run(["--config", p, "--workdir", os.path.join(os.path.dirname(p), "wd"), *argv], 120))


_GOOD_FILE = "import ml_collections\ndef get_config(arg=None):\n  c = ml_collections.ConfigDict()\n" \
             "  c.train = dict(steps={steps})\n  return c\n"


@case("config")
def _steps_not_a_number(ws):
  return _cfg(ws, "--config.train.steps=abc")


@case("config")
def _negative_steps(ws):
  return _cfg(ws, "--config.train.steps=-5")


@case("config")
def _negative_width(ws):
  return _cfg(ws, "--config.model.d_model=-64")


@case("config")
def _zero_batch(ws):
  return _cfg(ws, "--config.data.global_batch=0")


@case("config")
def _lr_not_a_number(ws):
  return _cfg(ws, "--config.optim.lr=fast")


@case("config")
def _bool_not_a_bool(ws):
  return _cfg(ws, "--config.train.progress=maybe")


@case("config")
def _fractional_layers(ws):
  return _cfg(ws, "--config.model.n_layers=2.5")


@case("config")
def _keep_zero_checkpoints(ws):
  return _cfg(ws, "--config.checkpoint.keep=0")


@case("config")
def _typo_in_key(ws):
  return _cfg(ws, "--config.train.stepz=5")


@case("config")
def _config_file_missing(ws):
  return classify(run(["--config", "experiments/configs/no_such.py", "--workdir", ws.fresh("cfg")], 120))


@case("config")
def _file_with_wrong_type(ws):
  return _cfg_file(ws, "wrongtype", _GOOD_FILE.format(steps='"40"'))


@case("config")
def _file_with_syntax_error(ws):
  return _cfg_file(ws, "syntax", "def get_config(arg=None)\n  return {}\n")


@case("config")
def _file_raises(ws):
  return _cfg_file(ws, "raises", "def get_config(arg=None):\n  return {'train': dict(steps=1 // 0)}\n")


@case("config")
def _file_without_get_config(ws):
  return _cfg_file(ws, "noget", "x = 1\n")


@case("config")
def _config_argument_wrong_type(ws):
  return classify(run(["--config", "experiments/configs/hotswap.py:nodes=abc", "--workdir", ws.fresh("cfg")], 120))


@case("config")
def _resilience_setting_wrong_type(ws):
  return _cfg(ws, "--config.extras.resilience.startup_timeout_s=soon", config=HS)


@case("config")
def _resilience_negative_persist(ws):
  return _cfg(ws, "--config.extras.resilience.persist_every=-1", config=HS)


@case("config")
def _resilience_negative_spares(ws):
  return _cfg(ws, "--config.extras.resilience.spares=-1", config=HS)


@case("config")
def _resilience_unknown_failure_kind(ws):
  return _cfg(ws, "--config.extras.resilience.fail_kind=meteor", config=HS)


# ------------------------------------------------------------------------------------------ checkpoints

def _ck_argv(workdir, steps, *extra):
  return ["--config", QS + ":runlocal=True", "--workdir", workdir, f"--config.train.steps={steps}",
          "--config.mesh.data=1", "--config.mesh.tensor=1", "--config.train.sample_tokens=0",
          "--config.train.progress=False", "--config.train.log_every=1", "--config.checkpoint.every=2",
          "--config.checkpoint.keep=20", *extra]


def _ck_run(ws, workdir, steps, *extra, timeout_s=300):
  return run(_ck_argv(workdir, steps, *extra), timeout_s, extra_env=ws.cache_env)


def _ck_reference(ws, steps):
  """Final loss of an uninterrupted run of ``steps`` steps (resuming is bit-exact, so a recovered run matches)."""
  def build():
    r = _ck_run(ws, ws.fresh(f"ck_reference_{steps}"), steps)
    assert r.rc == 0, r.err[-2000:]
    return summary_json(r)["final_loss"]
  return ws.memo(("ck_ref", steps), build)


def _ck_template(ws, name="good", *extra):
  """A workdir with checkpoints at steps 2 and 4 (copied, never modified, by the cases)."""
  def build():
    wd = os.path.join(ws.root, "templates", name)
    shutil.rmtree(wd, ignore_errors=True)
    r = _ck_run(ws, wd, 4, *extra)
    assert r.rc == 0 and ckpt_lib.step_dirs(ckpt_lib.checkpoint_dir(wd)) == [4, 2], r.err[-2000:]
    return wd
  return ws.memo(("ck_tpl", name, extra), build)


def _resumed(step):
  return lambda r, ws, steps: f"resumed from step {step}" in r.err and \
      summary_json(r).get("final_loss") == _ck_reference(ws, steps)


def _ck_case(ws, name, mutate, steps=6, resume_at=2, template="good", template_extra=()):
  wd = ws.fresh(name)
  shutil.copytree(_ck_template(ws, template, *template_extra), wd, dirs_exist_ok=True)
  mutate(wd)
  before = committed_files(wd)
  r = _ck_run(ws, wd, steps)
  o = classify(r, (lambda rr: _resumed(resume_at)(rr, ws, steps)) if resume_at is not None else None)
  lost = lost_files(before, wd)
  if lost:
    o.data_lost, o.detail = True, f"{o.detail} | lost {lost[:3]}"
  return o


def _step(wd, s=4):
  return os.path.join(wd, "checkpoints", str(s))


def _data_file(step_dir):
  return max(glob.glob(os.path.join(step_dir, "state", "ocdbt.process_0", "d", "*")), key=os.path.getsize)


def _flip_bit(wd, s=4):
  p = _data_file(_step(wd, s))
  b = bytearray(open(p, "rb").read())
  b[len(b) // 2] ^= 0x10
  open(p, "wb").write(bytes(b))


def _truncate(wd):
  p = _data_file(_step(wd))
  b = open(p, "rb").read()
  open(p, "wb").write(b[:len(b) // 3])


def _remove(rel):
  def mutate(wd):
    p = os.path.join(_step(wd), rel)
    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
  return mutate


@case("checkpoint_corrupt")
def _flipped_bit_in_array_data(ws):
  return _ck_case(ws, "flipped_bit", _flip_bit)


@case("checkpoint_corrupt")
def _truncated_array_data(ws):
  return _ck_case(ws, "truncated", _truncate)


@case("checkpoint_corrupt")
def _garbage_metadata(ws):
  return _ck_case(ws, "garbage_meta", lambda wd: open(os.path.join(_step(wd), "state", "_METADATA"), "w").write("{x"))


@case("checkpoint_corrupt")
def _every_step_corrupt(ws):
  return _ck_case(ws, "all_corrupt", lambda wd: (_flip_bit(wd, 4), _flip_bit(wd, 2)), resume_at=None)


@case("checkpoint_partial")
def _missing_array_metadata(ws):
  return _ck_case(ws, "no_meta", _remove("state/_METADATA"))


@case("checkpoint_partial")
def _missing_data_item(ws):
  return _ck_case(ws, "no_data_item", _remove("data"))


@case("checkpoint_partial")
def _missing_process_data(ws):
  return _ck_case(ws, "no_process_data", _remove("state/ocdbt.process_0"))


@case("checkpoint_partial")
def _empty_step_folder(ws):
  def mutate(wd):
    shutil.rmtree(_step(wd))
    os.makedirs(_step(wd))
  return _ck_case(ws, "empty_step", mutate)


@case("checkpoint_partial")
def _leftover_tmp_of_interrupted_save(ws):
  return _ck_case(ws, "tmp_left", lambda wd: os.rename(_step(wd), _step(wd) + ".orbax-checkpoint-tmp"))


@case("checkpoint_foreign")
def _another_models_checkpoint(ws):
  return _ck_case(ws, "other_model", lambda wd: None, template="d32", template_extra=("--config.model.d_model=32",),
                  resume_at=None)


@case("checkpoint_foreign")
def _another_state_layout(ws):
  return _ck_case(ws, "other_layout", lambda wd: None, template="noscan",
                  template_extra=("--config.model.scan_layers=False",), resume_at=None)


@case("checkpoint_foreign")
def _not_an_orbax_folder(ws):
  def mutate(wd):
    for s in (2, 4):
      shutil.rmtree(_step(wd, s))
    os.makedirs(_step(wd, 7))
    open(os.path.join(_step(wd, 7), "notes.txt"), "w").write("a folder named like a step")
  return _ck_case(ws, "not_orbax", mutate, resume_at=None)


@case("checkpoint_foreign")
def _checkpoints_is_a_file(ws):
  def mutate(wd):
    shutil.rmtree(os.path.join(wd, "checkpoints"))
    open(os.path.join(wd, "checkpoints"), "w").write("not a folder")
  return _ck_case(ws, "ckpt_file", mutate, resume_at=None)


@case("checkpoint_kill", timeout_s=600)
def _sigkill_during_async_save(ws):
  """Kill the trainer the moment an async save's tmp folder appears (step >= 4); the rerun must resume from
  the newest committed step and end at the uninterrupted run's loss."""
  steps = 8
  for attempt in range(4):
    wd = ws.fresh(f"kill_save_{attempt}")
    proc = start(_ck_argv(wd, steps), ws.cache_env)
    ck = os.path.join(wd, "checkpoints")
    caught = None
    while proc.poll() is None:
      tmp = glob.glob(os.path.join(ck, "*.orbax-checkpoint-tmp*"))
      steps_in_flight = [int(os.path.basename(t).split(".")[0]) for t in tmp]
      if steps_in_flight and max(steps_in_flight) >= 4:
        os.killpg(proc.pid, signal.SIGKILL)
        caught = max(steps_in_flight)
        break
      time.sleep(0.002)
    finish(proc, 60)
    if caught is None:
      continue  # the save finished between two looks: try again
    committed = ckpt_lib.step_dirs(ck)
    before = committed_files(wd)
    r = _ck_run(ws, wd, steps)
    want = max([s for s in committed if s < caught], default=None) if caught not in committed else caught
    o = classify(r, lambda rr: f"resumed from step {want}" in rr.err and
                 summary_json(rr).get("final_loss") == _ck_reference(ws, steps))
    o.detail = f"killed during the save of step {caught}; committed {committed}; {o.detail}"
    o.data_lost = bool(lost_files(before, wd))
    return o
  return Outcome("silent", "could not catch a save in flight in 4 attempts (nothing was checked)")


# ------------------------------------------------------------------------------------------ hot swap

def _hs_argv(ws, workdir, steps, **res):
  opts = {"compile_cache_dir": ws.cache, "heartbeat_timeout_s": 3.0, "wall_timeout_s": 590}
  opts.update(res)
  # keep every checkpoint: the data-lost check must not mistake orbax's max_to_keep clean-up for a loss
  return ["--config", HS, "--workdir", workdir, f"--config.train.steps={steps}", "--config.checkpoint.keep=100",
          *[f"--config.extras.resilience.{k}={v}" for k, v in opts.items()]]


def _metrics(wd) -> dict:
  """step -> every loss reported for it (by every generation and every run in this workdir)."""
  out = {}
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    for line in f:
      m = json.loads(line)
      out.setdefault(m["step"], []).append(m["loss"])
  return out


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
    return {"losses": {s: v[0] for s, v in _metrics(wd).items()}, "final": _final_bytes(wd, nodes)}
  return ws.memo(("hs_ref", steps, nodes), build)


def _same_as_reference(ws, wd, steps, **res):
  nodes = res.get("nodes", 4)
  ref = _hs_reference(ws, steps, nodes)
  got = _metrics(wd)
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
