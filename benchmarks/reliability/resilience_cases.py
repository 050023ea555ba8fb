"""The config and checkpoint cases (registered into ``resilience_area.CASES``), by class; the hot-swap ones
are in ``hotswap_cases.py``.

config: type errors, out-of-range sizes and broken config files, on the command line and in files;
checkpoint_corrupt / checkpoint_partial / checkpoint_foreign: a plain training workdir whose checkpoints were
damaged, cut short, or written by another model (a rerun must resume from the newest good step, bit-exact, or
stop with one line); checkpoint_kill: the trainer SIGKILLed while an async save writes.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import time

from benchmarks.reliability.harness import committed_files, finish, lost_files, run, start, summary_json
from benchmarks.reliability.resilience_area import Outcome, case, classify
from framework import checkpoint as ckpt_lib

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
