"""Bad-input and fault cases of the resilience / checkpoint / config area, for the reliability benchmark
(``benchmarks/reliability_resilience.py``; ``benchmarks/reliability.py`` when it collects every area) and
``tests/resilience/test_faults.py``.

Every case feeds one bad input or one fault to the real entry point (``python -m experiments.run``, in a
subprocess in its own session) and classifies what happened, with the same outcome names as the ondevice
area's registry (``ondevice/faults.py``):
* ``recovered``: it did the job anyway, and the result was checked (the final loss, or every rank's final
  state bytes, equal an uninterrupted run's; it resumed from the step it should have);
* ``clear_error``: exit code 2/3/4/5, no traceback, and the last stderr line is exactly one
  ``config error: / checkpoint error: / hot-swap run failed: / workdir error: ...`` line that names a fix;
* ``unclear_error``: it failed, but not like that; ``crash``: a traceback or a signal; ``hang``: not done in
  its time limit; ``silent``: it ran and the result is wrong or unchecked;
* ``data_lost`` (a flag on any outcome): a committed checkpoint file is gone or changed (moved aside intact
  is fine), or a process / shared-memory segment of the job outlived it.
Cases are registered per class; ``faults_cases.py`` and ``faults_hotswap_cases.py`` define them and
``fault_suite.py`` loads them all (this module imports neither: no import cycle).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

AREA = "resilience"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ERROR_LINE = re.compile(r"^(config error|checkpoint error|hot-swap run failed|workdir error): ")
FIX_WORDS = re.compile(r"must be|must exceed|use |pass |move |rerun|resume with|choose|fix |set |raise |wait |add |"
                       r"stop |give |known|try |lower |delete |check |free ", re.I)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  klass: str  # a case class: one pytest test per class
  fn: Callable  # (Workspace) -> Outcome
  timeout_s: float = 300.0
  slow: bool = False  # minutes: only the slow tests and the benchmark run it


@dataclasses.dataclass
class Outcome:
  kind: str  # recovered | clear_error | unclear_error | crash | hang | silent
  detail: str = ""
  data_lost: bool = False
  seconds: float = 0.0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


CASES: List[Case] = []


def case(klass: str, timeout_s: float = 300.0, slow: bool = False):
  def deco(fn):
    CASES.append(Case(fn.__name__.lstrip("_"), klass, fn, timeout_s, slow))
    return fn
  return deco


def classes() -> list:
  return sorted({c.klass for c in CASES})


# ------------------------------------------------------------------------------------------ processes

@dataclasses.dataclass
class Run:
  rc: Optional[int]  # None: killed at its time limit
  out: str
  err: str
  left_pids: list
  left_shm: list
  seconds: float


def env() -> dict:
  e = dict(os.environ)
  e.pop("XLA_FLAGS", None)  # experiments.run sets the host device count itself
  e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
  e.setdefault("JAX_PLATFORMS", "cpu")
  return e


def start(argv: list, extra_env: Optional[dict] = None, module: str = "experiments.run") -> subprocess.Popen:
  """Output goes to files, not pipes: a process nobody reads from for a while must never block on a write."""
  fd_out, out_path = tempfile.mkstemp(prefix="prismllm-case-", suffix=".out")
  fd_err, err_path = tempfile.mkstemp(prefix="prismllm-case-", suffix=".err")
  try:
    proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, env={**env(), **(extra_env or {})},
                            stdout=fd_out, stderr=fd_err, stdin=subprocess.DEVNULL, start_new_session=True)
  finally:
    os.close(fd_out)
    os.close(fd_err)
  proc.out_path, proc.err_path = out_path, err_path
  return proc


def _read_and_remove(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      return f.read()
  except OSError:
    return ""
  finally:
    _unlink(path)


def finish(proc: subprocess.Popen, timeout_s: float, workdir: Optional[str] = None) -> Run:
  """Waits (hard limit), records what outlived the launcher (processes of its session, shared memory of
  its run), then removes those leftovers so they cannot leak into the next case."""
  t0 = time.time()
  try:
    proc.wait(timeout=timeout_s)
    rc = proc.returncode
  except subprocess.TimeoutExpired:
    rc = None
    _killpg(proc.pid)
    proc.wait()
  out, err = _read_and_remove(proc.out_path), _read_and_remove(proc.err_path)
  left = wait_gone(proc.pid, 15.0)
  shm = shm_of(workdir) if workdir else []
  _killpg(proc.pid)
  for pid in left:
    _kill(pid)
  for p in shm:
    _unlink(p)
  return Run(rc, out or "", err or "", left, shm, time.time() - t0)


def run(argv: list, timeout_s: float, workdir: Optional[str] = None, extra_env: Optional[dict] = None) -> Run:
  return finish(start(argv, extra_env), timeout_s, workdir)


def _kill(pid: int, sig=signal.SIGKILL):
  try:
    os.kill(pid, sig)
  except ProcessLookupError:
    pass


def _killpg(pgid: int):
  try:
    os.killpg(pgid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _unlink(p: str):
  try:
    os.unlink(p)
  except OSError:
    pass


def losses_by_step(wd: str) -> dict:
  """step -> every loss reported for it in this workdir's metrics.jsonl (every generation, every launch)."""
  out = {}
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    for line in f:
      m = json.loads(line)
      out.setdefault(m["step"], []).append(m["loss"])
  return out


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
  rids = [run_id] if run_id else run_ids_of(workdir)
  out = []
  for rid in rids:
    for d in ("/dev/shm", tempfile.gettempdir()):
      out += glob.glob(os.path.join(d, f"prismllm-{rid}-*"))
  return sorted(out)


# ------------------------------------------------------------------------------------------ classification

def classify(r: Run, ok: Optional[Callable[[Run], bool]] = None) -> Outcome:
  """``ok(run)`` checks a successful run's result (None: success is not expected, so a success is 'silent')."""
  lost = bool(r.left_pids or r.left_shm)
  leak = f" (left behind: processes {r.left_pids}, shared memory {r.left_shm})" if lost else ""
  if r.rc is None:
    return Outcome("hang", "no result within the time limit" + leak, lost)
  if "Traceback (most recent call last)" in r.err or "Traceback (most recent call last)" in r.out:
    return Outcome("crash", _last(r.err) + leak, lost)
  if r.rc < 0:
    return Outcome("crash", f"killed by signal {-r.rc}" + leak, lost)
  if r.rc == 0:
    if ok is not None and ok(r):
      return Outcome("recovered", _last(r.err) + leak, lost)
    return Outcome("silent", f"exit 0 but the result is wrong or unchecked: {_last(r.out)[:160]}" + leak, lost)
  lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
  errors = [ln for ln in lines if ERROR_LINE.match(ln)]
  if r.rc in (2, 3, 4, 5) and len(errors) == 1 and lines[-1] == errors[0] and FIX_WORDS.search(errors[0]):
    return Outcome("clear_error", errors[0][:400] + leak, lost)
  return Outcome("unclear_error", " | ".join(lines[-3:])[:400] + leak, lost)


def _last(s: str) -> str:
  lines = [ln for ln in s.strip().splitlines() if ln.strip()]
  return lines[-1][:300] if lines else ""


def summary_json(r: Run) -> dict:
  """The JSON object experiments.run prints last on stdout."""
  for ln in reversed(r.out.strip().splitlines()):
    if ln.startswith("{"):
      return json.loads(ln)
  return {}


# ------------------------------------------------------------------------------------------ data lost

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


def lost_files(before: Dict[str, str], workdir: str) -> list:
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


# ------------------------------------------------------------------------------------------ workspace

class Workspace:
  """Good workdirs the cases start from (built once, lazily) and a fresh folder per case, under ``root``."""

  def __init__(self, root: str, cache_dir: Optional[str] = None):
    self.root = os.path.abspath(root)
    os.makedirs(self.root, exist_ok=True)
    self.cache = cache_dir or os.path.join(self.root, "jax_cache")
    os.makedirs(self.cache, exist_ok=True)
    self._memo: dict = {}

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


def run_case(c: Case, ws: Workspace) -> Outcome:
  t0 = time.perf_counter()
  try:
    o = c.fn(ws)
  except Exception as e:  # noqa: BLE001 - a case whose harness part fails is reported, not hidden
    o = Outcome("crash", f"case harness: {type(e).__name__}: {str(e)[:300]}")
  o.seconds = time.perf_counter() - t0
  return o


def summarise(results: dict) -> dict:
  """The reliability keys (ondevice's registry prints the same): clear_errors counts clean refusals."""
  kinds = [r["kind"] for r in results.values()]
  return {"bad_inputs_tried": len(kinds), "recovered": kinds.count("recovered"),
          "clear_errors": kinds.count("clear_error"), "unclear_errors": kinds.count("unclear_error"),
          "crashes": kinds.count("crash"), "hangs": kinds.count("hang"), "silent": kinds.count("silent"),
          "data_lost": sum(bool(r["data_lost"]) for r in results.values())}
