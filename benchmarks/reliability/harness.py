"""The one harness of the reliability campaign: cases, outcomes, running a CLI in this process or a real entry
point in a subprocess, classifying what happened, and counting.

Every case feeds one bad input or one fault to a real entry point and ends in one outcome ``kind``:
* ``recovered``: it did the job anyway, and the result was checked (the final loss or state bytes equal an
  uninterrupted run's; a GGUF from another writer generates what our own file of the same weights does);
* ``clear_error``: a refusal as its area writes one (:class:`Refusal`): no traceback, one error line that names
  a fix;
* ``unclear_error``: it failed, but not like that; ``crash``: a traceback, an exception or a signal;
  ``hang``: not done in its time limit; ``silent``: it ran and the result is wrong or unchecked;
* ``not_exercised``: the case could not make its fault happen (a run that finished before its signal could be
  sent, a signal that never landed inside the save): nothing was checked, so it counts neither as a pass nor as
  a failure of the system, and the campaign lists it apart;
* ``data_lost`` (a flag on any outcome): a file that was there before is gone or changed (moved aside intact is
  fine), or a process / shared-memory segment of the job outlived it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("recovered", "clear_error", "unclear_error", "crash", "hang", "silent", "not_exercised")
OK_KINDS = ("recovered", "clear_error")
COUNTS = ("bad_inputs_tried", "recovered", "clear_errors", "unclear_errors", "crashes", "hangs", "silent",
          "not_exercised", "data_lost")


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  klass: str  # a case class: one pytest test per class
  fn: Callable  # (Workspace) -> Outcome
  timeout_s: float = 300.0
  slow: bool = False  # minutes: only the slow tests and the campaign run it
  acceptable: tuple = OK_KINDS  # outcomes the tests accept ('silent' only where damage is undetectable)


@dataclasses.dataclass
class Outcome:
  kind: str  # one of KINDS
  detail: str = ""
  data_lost: bool = False
  seconds: float = 0.0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class NotExercised(Exception):
  """Raised by a case that could not make its fault happen; run_case reports it as ``not_exercised``."""


class Registry:
  """An area's cases, registered with the ``case`` decorator by its case modules."""

  def __init__(self, area: str, timeout_s: float):
    self.area, self.timeout_s, self.cases = area, timeout_s, []

  def case(self, klass: str, timeout_s: Optional[float] = None, slow: bool = False, undetectable: bool = False):
    def deco(fn):
      self.cases.append(Case(fn.__name__.lstrip("_"), klass, fn, timeout_s or self.timeout_s, slow,
                             OK_KINDS + (("silent",) if undetectable else ())))
      return fn
    return deco

  def classes(self) -> list:
    return sorted({c.klass for c in self.cases})


# ------------------------------------------------------------------------------------------ workspace

class Workspace:
  """Where a case works: ``root``, a fresh folder per case, built-once values, and a compilation cache."""

  def __init__(self, root: str, cache_dir: Optional[str] = None):
    self.root = os.path.abspath(root)
    os.makedirs(self.root, exist_ok=True)
    self.cache = cache_dir or os.path.join(self.root, "jax_cache")
    os.makedirs(self.cache, exist_ok=True)
    self._memo: dict = {}

  def path(self, name: str) -> str:
    return os.path.join(self.root, name)

  def fresh(self, name: str) -> str:
    p = os.path.join(self.root, "cases", name)
    shutil.rmtree(p, ignore_errors=True)
    os.makedirs(p)
    return p

  def memo(self, key, build: Callable):
    if key not in self._memo:
      self._memo[key] = build()
    return self._memo[key]

  @property
  def cache_env(self) -> dict:
    return {"JAX_COMPILATION_CACHE_DIR": os.path.join(self.cache, "xla"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


# ------------------------------------------------------------------------------------------ classification

@dataclasses.dataclass
class Run:
  rc: Optional[int]  # None: no exit within its time limit
  out: str
  err: str
  left_pids: list = dataclasses.field(default_factory=list)
  left_shm: list = dataclasses.field(default_factory=list)
  seconds: float = 0.0
  exc: Optional[BaseException] = None  # an exception that escaped a CLI run in this process

  def __post_init__(self):
    _TRANSCRIPT.append(self)


_TRANSCRIPT: List[Run] = []  # the runs of the case in progress (run_case keeps them when the outcome is bad)


@dataclasses.dataclass(frozen=True)
class Refusal:
  """What a clear refusal looks like in an area: exit code (``codes``; empty: any positive), one stderr line
  matching ``line`` that names a fix (``fix``), and either that line last (``last``) or every other stderr
  line a usage / warning line (``only_usage``)."""
  line: re.Pattern
  fix: re.Pattern
  codes: tuple = ()
  last: bool = False
  only_usage: bool = False


class Timeout(Exception):
  pass


def classify(r: Run, refusal: Refusal, ok: Optional[Callable[[Run], bool]] = None) -> Outcome:
  """Outcome of one run. ``ok(run)`` checks a successful run's result (None: success is not expected, so a
  success is 'silent')."""
  lost = bool(r.left_pids or r.left_shm)
  leak = f" (left behind: processes {r.left_pids}, shared memory {r.left_shm})" if lost else ""
  if isinstance(r.exc, Timeout) or (r.rc is None and r.exc is None):
    return Outcome("hang", "no result within the time limit" + leak, lost)
  if r.exc is not None:
    return Outcome("crash", f"{type(r.exc).__name__}: {str(r.exc)[:200]}" + leak, lost)
  if TRACEBACK in r.err or TRACEBACK in r.out:
    return Outcome("crash", exception_line(r.err if TRACEBACK in r.err else r.out) + leak, lost)
  if r.rc < 0:
    return Outcome("crash", f"killed by signal {-r.rc}" + leak, lost)
  if r.rc == 0:
    if ok is not None and ok(r):
      return Outcome("recovered", last_line(r.err) + leak, lost)
    return Outcome("silent", f"exit 0 but the result is wrong or unchecked: {last_line(r.out)[:160]}" + leak, lost)
  lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
  errors = [ln for ln in lines if refusal.line.match(ln)]
  shape = ((not refusal.last or lines[-1] == errors[0]) if len(errors) == 1 else False) and (
      not refusal.only_usage or all(ln.startswith(("usage:", " ", "warning:")) or refusal.line.match(ln)
                                    for ln in lines))
  if (not refusal.codes or r.rc in refusal.codes) and shape and refusal.fix.search(errors[0]):
    return Outcome("clear_error", errors[0][:400] + leak, lost)
  return Outcome("unclear_error", " | ".join(lines[-3:])[:400] + leak, lost)


TRACEBACK = "Traceback (most recent call last)"


def exception_line(s: str) -> str:
  """The exception a traceback ends with (the first unindented line after the last traceback's header)."""
  tail = s[s.rindex(TRACEBACK) + len(TRACEBACK):].splitlines()[1:]
  return next((ln[:300] for ln in tail if ln.strip() and not ln.startswith(" ")), last_line(s))


def last_line(s: str) -> str:
  lines = [ln for ln in s.strip().splitlines() if ln.strip()]
  return lines[-1][:300] if lines else ""


def run_case(c: Case, ws: Workspace) -> Outcome:
  """The case's outcome; when it is a failure, every run's exit code, stdout and stderr go to
  ``<workspace>/logs/<case>.log``."""
  t0 = time.perf_counter()
  _TRANSCRIPT.clear()
  try:
    o = c.fn(ws)
  except NotExercised as e:
    o = Outcome("not_exercised", str(e))
  except Timeout:
    o = Outcome("hang", "no result within the time limit")
  except Exception as e:  # noqa: BLE001 - a case whose harness part fails is reported, not hidden
    o = Outcome("crash", f"case harness: {type(e).__name__}: {str(e)[:300]}")
  o.seconds = time.perf_counter() - t0
  if o.kind not in ("recovered", "clear_error", "not_exercised"):
    _write_log(os.path.join(ws.root, "logs", f"{c.name}.log"), o)
  return o


def _write_log(path: str, o: Outcome):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(f"outcome {o.kind}: {o.detail}\n")
    for i, r in enumerate(_TRANSCRIPT):
      f.write(f"\n===== run {i}: exit {r.rc}, {r.seconds:.1f} s, exception {r.exc!r}\n"
              f"----- stdout\n{r.out}\n----- stderr\n{r.err}\n")


def run_until_exercised(c: Case, ws: Workspace, tries: int = 2) -> Outcome:
  """``run_case`` again while the case reports ``not_exercised`` (at most ``tries`` runs): what the tests use, so
  a fault that never happened fails them unless a retry made it happen."""
  for _ in range(tries):
    o = run_case(c, ws)
    if o.kind != "not_exercised":
      break
  return o


def summarise(results: dict) -> dict:
  """The campaign's counts over {name: outcome dict}; ``not_exercised`` cases are counted apart (never as
  recovered) and named."""
  kinds = [r["kind"] for r in results.values()]
  out = {"bad_inputs_tried": len(kinds), "recovered": kinds.count("recovered"),
         "clear_errors": kinds.count("clear_error"), "unclear_errors": kinds.count("unclear_error"),
         "crashes": kinds.count("crash"), "hangs": kinds.count("hang"), "silent": kinds.count("silent"),
         "not_exercised": kinds.count("not_exercised"),
         "data_lost": sum(bool(r["data_lost"]) for r in results.values())}
  out["not_exercised_cases"] = sorted(n for n, r in results.items() if r["kind"] == "not_exercised")
  return out


# ------------------------------------------------------------------------------------------ in this process

def invoke(main: Callable, argv: list, timeout_s: float = 120.0) -> Run:
  """Runs a CLI ``main(argv)`` in this process, its output captured. A SIGALRM timer turns a hang that returns to
  Python into ``Timeout`` (main thread only)."""
  out, err = io.StringIO(), io.StringIO()
  exc, rc = None, None
  use_alarm = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
  if use_alarm:
    old = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
  t0 = time.perf_counter()
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      rc = main(argv)
    rc = 0 if rc is None else rc
  except SystemExit as e:  # argparse errors
    rc = e.code if isinstance(e.code, int) else 0 if e.code is None else 2
  except BaseException as e:  # noqa: BLE001 - anything escaping the CLI is a crash (Timeout: a hang)
    exc = e
  finally:
    if use_alarm:
      signal.setitimer(signal.ITIMER_REAL, 0)
      signal.signal(signal.SIGALRM, old)
  return Run(rc, out.getvalue(), err.getvalue(), seconds=time.perf_counter() - t0, exc=exc)


def _raise_timeout(*_):
  raise Timeout("time limit")


# ------------------------------------------------------------------------------------------ subprocesses

def env(extra: Optional[dict] = None) -> dict:
  e = dict(os.environ)
  e.pop("XLA_FLAGS", None)  # experiments.run sets the host device count itself
  e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
  e.setdefault("JAX_PLATFORMS", "cpu")
  return {**e, **(extra or {})}


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _ignored_stop_signals() -> list:
  return [s for s in STOP_SIGNALS if signal.getsignal(s) is signal.SIG_IGN]


@functools.lru_cache(maxsize=None)
def _env_resets_signals() -> bool:
  """GNU env (coreutils >= 8.31) can reset a signal to its default before it execs."""
  try:
    return subprocess.run(["env", "--default-signal=INT", "true"], capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


def _default_stop_signals():
  for sig in STOP_SIGNALS:
    signal.signal(sig, signal.SIG_DFL)


def start(argv: list, extra_env: Optional[dict] = None, module: Optional[str] = "experiments.run") -> subprocess.Popen:
  """``python -m module argv`` (``module`` None: ``python argv``) in its own session. Output goes to files, not
  pipes: a process nobody reads from for a while must never block on a write.

  The run gets SIGINT / SIGTERM as a user's shell delivers them even when this process ignores them (a campaign
  started in the background by a non-interactive shell, or under nohup, ignores SIGINT): an ignored signal stays
  ignored across exec, and every SIGINT case would then signal a run that cannot hear it. ``env
  --default-signal`` resets them before the exec (a ``preexec_fn`` where that env is missing)."""
  fd_out, out_path = tempfile.mkstemp(prefix="prismllm-case-", suffix=".out")
  fd_err, err_path = tempfile.mkstemp(prefix="prismllm-case-", suffix=".err")
  cmd = [sys.executable, *(["-m", module] if module else []), *argv]
  ignored, preexec = _ignored_stop_signals(), None
  if ignored and _env_resets_signals():
    cmd = ["env", "--default-signal=" + ",".join(s.name[3:] for s in ignored), *cmd]
  elif ignored:
    preexec = _default_stop_signals
  try:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(extra_env), stdout=fd_out, stderr=fd_err,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec)
  finally:
    os.close(fd_out)
    os.close(fd_err)
  proc.out_path, proc.err_path = out_path, err_path
  return proc


def _read_and_remove(path: str) -> str:
  """The file's text as written (bytes decoded, no newline translation: generated text may hold a bare \\r)."""
  try:
    with open(path, "rb") as f:
      return f.read().decode(errors="replace")
  except OSError:
    return ""
  finally:
    unlink(path)


def finish(proc: subprocess.Popen, timeout_s: float, workdir: Optional[str] = None, gone_s: float = 15.0) -> Run:
  """Waits (hard limit), records what outlived the launcher (processes of its session, shared memory of its run),
  then removes those leftovers so they cannot leak into the next case. ``gone_s``: how long the launcher's
  session may take to empty after it exited."""
  t0 = time.time()
  try:
    proc.wait(timeout=timeout_s)
    rc = proc.returncode
  except subprocess.TimeoutExpired:
    rc = None
    killpg(proc.pid)
    proc.wait()
  out, err = _read_and_remove(proc.out_path), _read_and_remove(proc.err_path)
  left = wait_gone(proc.pid, gone_s)
  shm = shm_of(workdir) if workdir else []
  killpg(proc.pid)
  for pid in left:
    kill(pid)
  for p in shm:
    unlink(p)
  return Run(rc, out or "", err or "", left, shm, time.time() - t0)


def run(argv: list, timeout_s: float, workdir: Optional[str] = None, extra_env: Optional[dict] = None,
        module: str = "experiments.run") -> Run:
  return finish(start(argv, extra_env, module), timeout_s, workdir)


def kill(pid: int, sig=signal.SIGKILL):
  try:
    os.kill(pid, sig)
  except ProcessLookupError:
    pass


def killpg(pgid: int, sig=signal.SIGKILL):
  try:
    os.killpg(pgid, sig)
  except ProcessLookupError:
    pass


def unlink(p: str):
  try:
    os.unlink(p)
  except OSError:
    pass


def session_pids(sid: int) -> list:
  """Live processes of session ``sid`` (a launcher started with start_new_session: agents, zygotes, workers)."""
  out = []
  for d in os.listdir("/proc"):
    if not d.isdigit():
      continue
    try:
      with open(f"/proc/{d}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if fields[0] not in ("Z", "X") and int(fields[3]) == sid:  # state, ppid, pgrp, session
      out.append(int(d))
  return out


def wait_gone(sid: int, timeout_s: float) -> list:
  end = time.time() + timeout_s
  while True:
    pids = session_pids(sid)
    if not pids or time.time() > end:
      return pids
    time.sleep(0.2)


def run_ids_of(workdir) -> list:
  try:
    with open(os.path.join(str(workdir), "run_id")) as f:
      return [x.strip() for x in f if x.strip()]
  except OSError:
    return []


def shm_of(workdir, run_id: Optional[str] = None) -> list:
  """Shared-memory segments of this workdir's runs (or of ``run_id``) still on the host."""
  rids = [run_id] if run_id else run_ids_of(workdir)
  out = []
  for rid in rids:
    for d in ("/dev/shm", tempfile.gettempdir()):
      out += glob.glob(os.path.join(d, f"prismllm-{rid}-*"))
  return sorted(out)


def wait_for(proc: subprocess.Popen, seen: Callable[[], bool], timeout_s: float, poll_s: float = 0.005) -> bool:
  """Polls ``seen()`` until it holds (True), the process exits or the time is up (False)."""
  end = time.time() + timeout_s
  while proc.poll() is None and time.time() < end:
    if seen():
      return True
    time.sleep(poll_s)
  return seen()


# ------------------------------------------------------------------------------------------ results on disk

def losses_by_step(wd: str) -> dict:
  """step -> every loss reported for it in this workdir's metrics.jsonl (every generation, every launch)."""
  out = {}
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    for line in f:
      m = json.loads(line)
      if "loss" in m:
        out.setdefault(m["step"], []).append(m["loss"])
  return out


def summary_json(r: Run) -> dict:
  """The JSON object an entry point prints last on stdout."""
  for ln in reversed(r.out.strip().splitlines()):
    if ln.startswith("{"):
      return json.loads(ln)
  return {}


def file_hashes(root: str) -> Dict[str, str]:
  out = {}
  for p in glob.glob(os.path.join(root, "**"), recursive=True):
    if os.path.isfile(p):
      with open(p, "rb") as f:
        out[os.path.relpath(p, root)] = hashlib.sha1(f.read()).hexdigest()
  return out


def committed_files(workdir: str) -> Dict[str, str]:
  """Files of finalized checkpoint steps (``checkpoints/<digits>/...``): the data a case must never lose."""
  return {k: v for k, v in file_hashes(workdir).items() if re.match(r"checkpoints/\d+/", k)}


def lost_files(before: Dict[str, str], workdir: str) -> List[str]:
  """Files of ``before`` that are neither in place nor moved aside intact (``checkpoints_bad/<step>[-n]/``)."""
  now = file_hashes(workdir)
  lost = []
  for rel, h in before.items():
    if now.get(rel) == h:
      continue
    _, step, rest = rel.split("/", 2)
    aside = [k for k, v in now.items() if v == h and re.fullmatch(rf"checkpoints_bad/{step}(-\d+)?/{re.escape(rest)}", k)]
    if not aside:
      lost.append(rel)
  return lost
