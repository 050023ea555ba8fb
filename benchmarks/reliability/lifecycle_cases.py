"""A run's life cycle as a user meets it (registered into ``resilience_area.CASES``), by class.

stop: SIGINT / SIGTERM at a random step of a training run: it must save that step, say in one line how to
resume, and exit 130 / 0; the rerun resumes there and every loss equals an uninterrupted run's, bit for bit.
A second signal during that save exits at once and the last complete checkpoint stays usable. Every signal is
sent once the run has logged a chosen step (metrics.jsonl), the second one once the first is acknowledged on
stderr; a run that ends before its signal lands is tried again, and a case that never lands it is
``not_exercised``, never a pass.
stop_multiprocess: the same with ``--processes 2`` (jax's preemption sync point picks the step);
hotswap_stop (slow): SIGINT to the hot-swap launcher, which forwards it to the workers.
workdir: a second run on a live workdir (refused in one line within 10 s, the first run's files untouched), a
stale lock (taken over), a workdir that is a file, and a resume with another model shape, a missing corpus or
a binary corpus (refused before any file of the workdir changes).
disk_full: the disk fills while a checkpoint is written (a size-capped tmpfs, mounted as root): one line, no
partial checkpoint left, the earlier ones kept, and the rerun after freeing space resumes bit-identically.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

from benchmarks.reliability.harness import (NotExercised, file_hashes, finish, killpg, losses_by_step, run, start,
                                            summary_json)
from benchmarks.reliability.hotswap_cases import _hs_argv, _hs_reference, _same_as_reference
from benchmarks.reliability.resilience_area import Outcome, case, classify
from framework import checkpoint as ckpt_lib

QS = "experiments/configs/quickstart.py:runlocal=True"
STEPS = 60  # long enough for a signal to land mid-run, short enough for a reference run of seconds
STEPS_2P = 30  # two gloo processes step ~10x slower
ATTEMPTS = 6  # tries to land a signal where the case needs it before it is reported not_exercised
STOPPED = re.compile(r"^stopped by (SIG\w+) after step (\d+); checkpoint saved in (\S+)\. To resume")


def _corpus(ws) -> str:
  """A small text corpus (a few stdlib modules): the stdlib walk would cost every run seconds."""
  p = os.path.join(ws.root, "corpus.txt")
  if not os.path.exists(p):
    root = sysconfig.get_paths()["stdlib"]
    with open(p + ".tmp", "wb") as f:
      for name in ("argparse.py", "textwrap.py", "shlex.py", "string.py", "bisect.py"):
        with open(os.path.join(root, name), "rb") as g:
          f.write(g.read())
    os.replace(p + ".tmp", p)
  return p


def _argv(ws, wd, steps=STEPS, *extra):
  return ["--config", QS, "--workdir", wd, f"--config.train.steps={steps}", "--config.mesh.data=1",
          "--config.mesh.tensor=1", "--config.train.sample_tokens=0", "--config.train.progress=False",
          "--config.train.log_every=1", "--config.train.peak_flops=1e12", f"--config.data.corpus={_corpus(ws)}",
          "--config.checkpoint.every=1000", "--config.checkpoint.keep=50", *extra]


def _on_disk(ws, key: str, build):
  """``build()`` once per workspace, kept as JSON: the benchmark runs every case in a fresh process."""
  p = os.path.join(ws.root, "references", re.sub(r"[^\w.-]", "_", key) + ".json")
  if os.path.exists(p):
    with open(p) as f:
      return json.load(f)
  out = build()
  os.makedirs(os.path.dirname(p), exist_ok=True)
  with open(p + ".tmp", "w") as f:
    json.dump(out, f)
  os.replace(p + ".tmp", p)
  return out


def _reference(ws, steps=STEPS, *extra) -> dict:
  """{step: loss} of an uninterrupted run (string keys, as stored)."""
  def build():
    wd = ws.fresh("ref_" + re.sub(r"\W", "_", "_".join((str(steps),) + extra))[:60])
    r = run(_argv(ws, wd, steps, *extra), 600, extra_env=ws.cache_env)
    assert r.rc == 0, r.err[-2000:]
    return {str(s): v[0] for s, v in losses_by_step(wd).items()}
  return _on_disk(ws, f"ref_{steps}_{'_'.join(extra)}", build)


def _same_losses(wd, ref: dict) -> bool:
  """Every loss this workdir recorded (every launch) equals the reference's at that step, and all its steps ran."""
  got = losses_by_step(wd)
  return {str(s) for s in got} == set(ref) and all(x == ref[str(s)] for s, v in got.items() for x in v)


def _wait_for_step(proc, wd, step: int, timeout_s: float = 300) -> bool:
  path, end = os.path.join(wd, "metrics.jsonl"), time.time() + timeout_s
  while proc.poll() is None and time.time() < end:
    try:
      with open(path) as f:
        if any(json.loads(ln).get("step", 0) >= step for ln in f if ln.strip()):
          return True
    except (OSError, ValueError):
      pass
    time.sleep(0.005)
  return False


def _wait_for_text(path: str, text: str, proc, timeout_s: float = 120) -> bool:
  end = time.time() + timeout_s
  while proc.poll() is None and time.time() < end:
    try:
      with open(path, errors="replace") as f:
        if text in f.read():
          return True
    except OSError:
      pass
    time.sleep(0.002)
  return False


def _stopped_line(r, sig: int):
  """(step, checkpoint path) from the run's last stderr line, or a reason why it is not the line a stop owes."""
  lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
  m = STOPPED.match(lines[-1]) if lines else None
  want_rc = 130 if sig == signal.SIGINT else 0
  if r.rc != want_rc or m is None or m.group(1) != signal.Signals(sig).name:
    return None, f"rc {r.rc} (want {want_rc}), last line {lines[-1][:200] if lines else '-'!r}"
  return (int(m.group(2)), m.group(3)), ""


def _stop_and_resume(ws, name: str, sig: int, argv_of, ref: dict, lo: int = 4, hi: int = 30, tries: int = ATTEMPTS):
  """Signals the launcher once the run reached a random step in [lo, hi); checks the stop, then the rerun."""
  for attempt in range(tries):
    wd = ws.fresh(f"{name}_{attempt}")
    at = random.randrange(lo, hi)
    proc = start(argv_of(wd), ws.cache_env)
    if not _wait_for_step(proc, wd, at):
      r = finish(proc, 60, wd)
      if r.rc == 0:
        continue  # finished before the signal could be sent: try again
      return classify(r)
    os.kill(proc.pid, sig)
    r = finish(proc, 300, wd)
    if "Traceback (most recent call last)" in r.err or r.rc is None:
      return classify(r)
    if r.rc == 0 and not (r.err.strip().splitlines() or [""])[-1].startswith("stopped by"):
      continue  # the run ended before the signal was handled
    got, why = _stopped_line(r, sig)
    if got is None:
      return Outcome("unclear_error", f"signal at step >= {at}: {why}")
    step, where = got
    problem = ckpt_lib.quick_check(ckpt_lib.checkpoint_dir(wd), step)
    ran = max(losses_by_step(wd))
    if step < at or ran != step or problem or os.path.realpath(where) != os.path.realpath(
        os.path.join(ckpt_lib.checkpoint_dir(wd), str(step))):
      return Outcome("silent", f"signal at step >= {at}; stopped after {step}, ran {ran}, checkpoint {where}: "
                               f"{problem or 'not the step it stopped at'}")
    r2 = run(argv_of(wd), 600, wd, ws.cache_env)
    o = classify(r2, lambda rr: f"resumed from step {step}" in rr.err and _same_losses(wd, ref))
    o.detail = (f"{signal.Signals(sig).name} once step {at} was logged (attempt {attempt + 1}); saved step {step}; "
                f"rerun: {o.detail}")
    return o
  raise NotExercised(f"the run finished before the signal was handled in {tries} attempts (nothing was checked)")


# ------------------------------------------------------------------------------------------ stop

@case("stop", timeout_s=900)
def _sigint_at_a_random_step(ws):
  return _stop_and_resume(ws, "sigint", signal.SIGINT, lambda wd: _argv(ws, wd), _reference(ws))


@case("stop", timeout_s=900)
def _sigterm_at_a_random_step(ws):
  return _stop_and_resume(ws, "sigterm", signal.SIGTERM, lambda wd: _argv(ws, wd), _reference(ws))


@case("stop", timeout_s=900)
def _second_sigint_during_the_save(ws):
  """Two SIGINTs: the second (sent as soon as the first is acknowledged) exits at once; every checkpoint
  left is complete and the rerun resumes from the newest, bit-identical to an uninterrupted run."""
  extra = ("--config.checkpoint.every=5",)
  ref = _reference(ws, STEPS, *extra)
  for attempt in range(ATTEMPTS):
    wd = ws.fresh(f"second_sigint_{attempt}")
    proc = start(_argv(ws, wd, STEPS, *extra), ws.cache_env)
    if not _wait_for_step(proc, wd, random.randrange(12, 30)):
      finish(proc, 60, wd)
      continue
    os.kill(proc.pid, signal.SIGINT)
    if not _wait_for_text(proc.err_path, "SIGINT received", proc):
      r = finish(proc, 0 if proc.poll() is None else 60, wd)
      if r.rc == 0:
        continue  # the run finished before the signal: try again
      o = classify(r)
      o.detail = f"the first SIGINT was not acknowledged within 120 s: {o.detail}"
      return o
    os.kill(proc.pid, signal.SIGINT)
    r = finish(proc, 120, wd)
    if r.rc == 130 and "second SIGINT: exiting at once" not in r.err:
      continue  # the first stop finished before the second signal came: try again
    if r.rc != 130 or "Traceback (most recent call last)" in r.err:
      return classify(r)
    ck = ckpt_lib.checkpoint_dir(wd)
    steps = ckpt_lib.step_dirs(ck)
    bad = {s: ckpt_lib.quick_check(ck, s) for s in steps if ckpt_lib.quick_check(ck, s)}
    if bad or not steps:
      return Outcome("silent", f"after the second SIGINT: steps {steps}, incomplete {bad}", data_lost=bool(bad))
    r2 = run(_argv(ws, wd, STEPS, *extra), 600, wd, ws.cache_env)
    o = classify(r2, lambda rr: f"resumed from step {steps[0]}" in rr.err and _same_losses(wd, ref))
    o.detail = f"exited at once (attempt {attempt + 1}); complete steps {steps}; rerun: {o.detail}"
    return o
  raise NotExercised(f"no second SIGINT landed during the save in {ATTEMPTS} attempts (nothing was checked)")


@case("stop_multiprocess", timeout_s=1500)
def _sigint_with_two_processes(ws):
  def argv(wd):  # the quickstart's data=2 x tensor=4 mesh over 2 processes of 4 emulated devices
    a = _argv(ws, wd, STEPS_2P)
    a = [x for x in a if not x.startswith(("--config.mesh.data", "--config.mesh.tensor"))]
    return a + ["--processes", "2"]
  ref = _on_disk(ws, f"ref_two_processes_{STEPS_2P}", lambda: _two_process_reference(ws, argv))
  return _stop_and_resume(ws, "sigint_2p", signal.SIGINT, argv, ref, lo=4, hi=15)


def _two_process_reference(ws, argv):
  wd = ws.fresh("ref_two_processes")
  r = run(argv(wd), 900, extra_env=ws.cache_env)
  assert r.rc == 0, r.err[-2000:]
  return {str(s): v[0] for s, v in losses_by_step(wd).items()}


@case("hotswap_stop", timeout_s=1500, slow=True)
def _sigint_to_the_hotswap_launcher(ws):
  """SIGINT to the launcher: the workers save at a step they agree on; the rerun resumes from it and every loss
  and the final state of every rank equal a failure-free run's."""
  steps, res = 40, {"nodes": 2, "spares": 0, "persist_every": 100}
  _hs_reference(ws, steps, 2)
  for attempt in range(3):
    wd = ws.fresh(f"hs_stop_{attempt}")
    proc = start(_hs_argv(ws, wd, steps, **res))
    if not _wait_for_step(proc, wd, random.randrange(3, 20), 600):
      finish(proc, 60, wd)
      continue
    os.kill(proc.pid, signal.SIGINT)
    r = finish(proc, 300, wd)
    got, why = _stopped_line(r, signal.SIGINT)
    if got is None:
      return classify(r) if r.rc != 130 else Outcome("unclear_error", why)
    step = got[0]
    if ckpt_lib.quick_check(ckpt_lib.checkpoint_dir(wd), step) or max(losses_by_step(wd)) != step:
      return Outcome("silent", f"stopped after {step} but that checkpoint is missing or the run went on")
    r2 = run(_hs_argv(ws, wd, steps, **res), 600, wd)
    o = classify(r2, lambda rr: summary_json(rr).get("resumed_from") == step and
                 _same_as_reference(ws, wd, steps, **res))
    o.detail = f"saved step {step} (attempt {attempt + 1}); rerun: {o.detail}"
    if r.left_pids or r.left_shm:
      o.data_lost, o.detail = True, f"left behind {r.left_pids} {r.left_shm}; {o.detail}"
    return o
  raise NotExercised("the job finished before the signal in 3 attempts (nothing was checked)")


# ------------------------------------------------------------------------------------------ workdir

@case("workdir", timeout_s=600)
def _second_run_on_a_live_workdir(ws):
  """The first run's session is frozen (SIGSTOP, seen in /proc) while the second starts, so any file change is the
  second's doing; then it is continued and stopped with SIGINT, which it must acknowledge and obey (exit 130)."""
  wd = ws.fresh("in_use")
  first = start(_argv(ws, wd, 100_000), ws.cache_env)
  if not _wait_for_step(first, wd, 3):
    return classify(finish(first, 60, wd))
  killpg(first.pid, signal.SIGSTOP)
  if not _wait_for_state(first.pid, "T", 10):
    finish(first, 0, wd)
    raise NotExercised("the first run did not stop on SIGSTOP within 10 s (nothing was checked)")
  before = file_hashes(wd)
  t0 = time.time()
  r = run(_argv(ws, wd, 100_000), 60, extra_env=ws.cache_env)
  took = time.time() - t0
  after = file_hashes(wd)
  killpg(first.pid, signal.SIGCONT)
  os.kill(first.pid, signal.SIGINT)
  heard = _wait_for_text(first.err_path, "SIGINT received", first, 60)
  r1 = finish(first, 300, wd)
  o = classify(r)
  if o.kind == "clear_error" and (f"pid {first.pid}" not in o.detail or took > 10):
    o.kind, o.detail = "unclear_error", f"took {took:.1f} s, or does not name the holder: {o.detail}"
  o.detail = f"refused in {took:.1f} s: {o.detail}"
  if r1.rc != 130:
    o.kind = "hang" if r1.rc is None else "unclear_error"
    o.detail = (f"the first run did not stop on SIGINT after SIGCONT (SIGINT acknowledged: {heard}, rc {r1.rc}, "
                f"last line {r1.err.strip().splitlines()[-1:]}); {o.detail}")
  if before != after:
    o.data_lost, o.detail = True, f"the second run changed the first run's files; {o.detail}"
  return o


def _wait_for_state(pid: int, state: str, timeout_s: float) -> bool:
  """Waits until /proc says process ``pid`` is in ``state`` ('T': stopped)."""
  end = time.time() + timeout_s
  while time.time() < end:
    try:
      with open(f"/proc/{pid}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[0] == state:
          return True
    except OSError:
      return False
    time.sleep(0.01)
  return False


@case("workdir", timeout_s=600)
def _stale_lock_of_a_killed_run(ws):
  """A run SIGKILLed mid-training leaves its lock line; the next run takes it over (saying so) and trains."""
  wd = ws.fresh("stale")
  first = start(_argv(ws, wd, 100_000), ws.cache_env)
  if not _wait_for_step(first, wd, 3):
    return classify(finish(first, 60, wd))
  os.killpg(first.pid, signal.SIGKILL)
  finish(first, 60, wd)
  os.remove(os.path.join(wd, "metrics.jsonl"))  # the killed run's losses belong to another schedule (steps)
  ref = _reference(ws)
  r = run(_argv(ws, wd), 600, wd, ws.cache_env)
  return classify(r, lambda rr: f"took over the stale lock of pid {first.pid}" in rr.err and _same_losses(wd, ref))


@case("workdir", timeout_s=120)
def _workdir_is_a_regular_file(ws):
  p = os.path.join(ws.fresh("wd_file"), "workdir")
  with open(p, "w") as f:
    f.write("not a folder")
  o = classify(run(_argv(ws, p), 120, extra_env=ws.cache_env))
  o.data_lost = open(p).read() != "not a folder"
  return o


def _trained(ws) -> str:
  """A finished 4-step workdir with checkpoints at steps 2 and 4 (copied, never modified, by the cases)."""
  def build():
    wd = os.path.join(ws.root, "templates", "lifecycle")
    shutil.rmtree(wd, ignore_errors=True)
    r = run(_argv(ws, wd, 4, "--config.checkpoint.every=2"), 600, extra_env=ws.cache_env)
    assert r.rc == 0 and ckpt_lib.step_dirs(ckpt_lib.checkpoint_dir(wd)) == [4, 2], r.err[-2000:]
    return wd
  return _on_disk(ws, "trained_workdir", build)


def _refused_without_a_change(ws, name: str, *extra) -> Outcome:
  wd = ws.fresh(name)
  shutil.copytree(_trained(ws), wd, dirs_exist_ok=True)
  before = file_hashes(wd)
  o = classify(run(_argv(ws, wd, 8, "--config.checkpoint.every=2", *extra), 300, extra_env=ws.cache_env))
  changed = sorted(k for k in set(before) | set(file_hashes(wd)) if before.get(k) != file_hashes(wd).get(k))
  if changed:
    o.data_lost, o.detail = True, f"files changed: {changed[:4]}; {o.detail}"
  return o


@case("workdir", timeout_s=300)
def _resume_with_another_model_shape(ws):
  return _refused_without_a_change(ws, "other_shape", "--config.model.d_model=32")


@case("workdir", timeout_s=300)
def _resume_with_a_missing_corpus(ws):
  return _refused_without_a_change(ws, "no_corpus", "--config.data.corpus=/no/such/corpus.txt")


@case("workdir", timeout_s=300)
def _binary_corpus(ws):
  o = _refused_without_a_change(ws, "binary_corpus", f"--config.data.corpus={sys.executable}")
  if o.kind == "clear_error" and "is not text" not in o.detail:
    o.kind = "unclear_error"
  return o


# ------------------------------------------------------------------------------------------ disk full

@case("disk_full", timeout_s=900)
def _disk_fills_while_saving(ws):
  """A 4-step run on a 6 MB tmpfs cut back to its step-2 checkpoint (as if stopped there), then the disk filled
  but for half a checkpoint: the rerun's save of step 4 fails."""
  mnt = ws.fresh("disk_full_mnt")
  m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", mnt], capture_output=True, text=True)
  if m.returncode != 0:
    return Outcome("unclear_error", f"could not mount a size-capped tmpfs (needs root): {m.stderr.strip()[:200]}; "
                                    f"nothing was checked")
  try:
    wd = os.path.join(mnt, "wd")
    argv = lambda steps: _argv(ws, wd, steps, "--config.checkpoint.every=2")  # noqa: E731
    r0 = run(argv(4), 300, extra_env=ws.cache_env)
    if r0.rc != 0:
      return classify(r0)
    shutil.rmtree(os.path.join(ckpt_lib.checkpoint_dir(wd), "4"))
    metrics = os.path.join(wd, "metrics.jsonl")
    with open(metrics) as f:
      kept = [ln for ln in f if json.loads(ln)["step"] <= 2]
    with open(metrics, "w") as f:
      f.writelines(kept)
    st = os.statvfs(mnt)
    step_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(wd, "checkpoints"))
                     for f in fs)
    filler = os.path.join(mnt, "filler")
    with open(filler, "wb") as f:
      f.write(b"\0" * max(st.f_bavail * st.f_frsize - step_bytes // 2, 0))
    before = {k: v for k, v in file_hashes(wd).items() if k.startswith("checkpoints/2/")}
    r = run(argv(4), 300, extra_env=ws.cache_env)
    o = classify(r)
    if o.kind == "clear_error" and "no space left on device" not in o.detail:
      o.kind = "unclear_error"
    left = ckpt_lib.partial_saves(ckpt_lib.checkpoint_dir(wd))
    after = {k: v for k, v in file_hashes(wd).items() if k.startswith("checkpoints/2/")}
    os.remove(filler)
    r2 = run(argv(4), 300, extra_env=ws.cache_env)
    ref = _reference(ws, 4, "--config.checkpoint.every=2")
    resumed = r2.rc == 0 and "resumed from step 2" in r2.err and _same_losses(wd, ref)
    if left or before != after or not resumed:
      o.data_lost = True
    o.detail = (f"{o.detail} | partial left {left}, step 2 intact {before == after}, resumed after freeing space "
                f"{resumed}")
    return o
  finally:
    subprocess.run(["umount", mnt], capture_output=True)
