"""Bad-input cases of the ondevice area, for ``benchmarks/reliability.py`` and ``tests/ondevice/test_faults.py``.

Every case feeds one bad input to a real entry point (``ondevice.run`` / ``ondevice.export`` / the loader)
and classifies what happened:
* ``recovered``: it did the job anyway, and the result was checked (a GGUF from another writer that loads
  and generates what our own file of the same weights does; a ring that loses a device and still prints
  the single-device greedy text);
* ``clear_error``: exit code 2 and exactly one ``error: ...`` line on stderr that names a fix;
* ``unclear_error``: it failed, but not with one such line; ``crash``: a traceback or an exception;
  ``hang``: it did not finish in its time limit; ``silent``: it ran and the output is wrong (undetectable
  damage, reported, never hidden); and ``data_lost`` flags a file that was there before and is damaged after.
Cases are registered per class (``CLASSES``); ``ondevice/faults_cases.py`` defines them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shutil
import signal
import struct
import time
from typing import Callable

import numpy as np

from ondevice.gguf_io import random_arrays, tiny_config  # noqa: F401  (the cases' models)

AREA = "ondevice"
FIX_WORDS = re.compile(r"re-export|re-copy|pass |raise |lower |rerun|fix |remove |give |add |use |run it with|"
                       r"export |choose |shorten|drop |free |pick ", re.I)


OK_KINDS = ("recovered", "clear_error")


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  klass: str  # a case class: one pytest test per class
  fn: Callable  # (Workspace) -> Outcome
  timeout_s: float = 120.0
  acceptable: tuple = OK_KINDS  # outcomes the tests accept ('silent' only where damage is undetectable)


@dataclasses.dataclass
class Outcome:
  kind: str  # recovered | clear_error | unclear_error | crash | hang | silent
  detail: str = ""
  data_lost: bool = False
  seconds: float = 0.0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


CASES: list = []


def case(klass: str, timeout_s: float = 120.0, undetectable: bool = False):
  def deco(fn):
    CASES.append(Case(fn.__name__.lstrip("_"), klass, fn, timeout_s, OK_KINDS + (("silent",) if undetectable else ())))
    return fn
  return deco


def classes() -> list:
  return sorted({c.klass for c in CASES})


# ------------------------------------------------------------------------------------------ workspace

class Workspace:
  """Good files the cases start from (our Q4_0 / Q8_0 exports of one random tiny model, a smaller draft,
  an 8-layer model for ring cases), in ``root``; corrupted copies are made next to them."""

  def __init__(self, root: str):
    from ondevice.gguf_io import write_arrays
    os.makedirs(root, exist_ok=True)
    self.root = root
    self.cfg = tiny_config()
    self.arrays = random_arrays(self.cfg)
    self.good = self._make("good-q4_0.gguf", lambda p: write_arrays(self.arrays, self.cfg, p, "q4_0"))
    self.good_q8 = self._make("good-q8_0.gguf", lambda p: write_arrays(self.arrays, self.cfg, p, "q8_0"))
    dcfg = tiny_config(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64)
    self.draft = self._make("draft-q8_0.gguf", lambda p: write_arrays(random_arrays(dcfg, 1), dcfg, p, "q8_0"))
    rcfg = tiny_config(n_layers=8, d_model=128)
    self.ring_model = self._make("ring-q8_0.gguf", lambda p: write_arrays(random_arrays(rcfg, 2), rcfg, p, "q8_0"))

  def _make(self, name, write):
    p = os.path.join(self.root, name)
    if not os.path.exists(p):
      write(p)
    return p

  def path(self, name: str) -> str:
    return os.path.join(self.root, name)

  def copy_with(self, name: str, mutate: Callable, src: str = None) -> str:
    data = bytearray(open(src or self.good, "rb").read())
    data = mutate(data)
    p = self.path(name)
    with open(p, "wb") as f:
      f.write(bytes(data))
    return p

  def devices(self, name: str, text: str) -> str:
    p = self.path(name)
    with open(p, "w") as f:
      f.write(text)
    return p


# ------------------------------------------------------------------------------------------ GGUF layout

def header_offsets(path: str) -> dict:
  """Byte offsets of the header's parts in a good file: ('kv', key) -> [offset of each part], ('tensor', name)
  -> [name_len, name, n_dims, dims, type, offset] part offsets, plus 'n_tensors' / 'n_kv' / 'data'."""
  from gguf import GGUFReader
  r = GGUFReader(path, "r")
  out = {"version": 4, "n_tensors": 8, "n_kv": 16, "data": int(r.data_offset)}
  for key, f in r.fields.items():
    offs, o = [], f.offset
    for part in f.parts:
      offs.append(o)
      o += part.nbytes
    out[("kv", key)] = offs
  for t in r.tensors:
    offs, o = [], t.field.offset
    for part in t.field.parts:
      offs.append(o)
      o += part.nbytes
    out[("tensor", t.name)] = offs
    out[("tensor_data", t.name)] = (int(t.data_offset), int(t.n_bytes))
  return out


def put(data: bytearray, off: int, fmt: str, value) -> bytearray:
  struct.pack_into("<" + fmt, data, off, value)
  return data


def flip(data: bytearray, off: int, bit: int = 7) -> bytearray:
  data[off] ^= 1 << bit
  return data


# ------------------------------------------------------------------------------------------ running

class _Timeout(Exception):
  pass


def invoke(main: Callable, argv: list, timeout_s: float = 120.0) -> tuple:
  """Runs a CLI ``main(argv)`` in this process: (return code, stdout, stderr, escaped exception or None).
  A SIGALRM timer turns a hang that returns to Python into ``_Timeout`` (main thread only)."""
  out, err = io.StringIO(), io.StringIO()
  exc = None
  rc = None
  use_alarm = hasattr(signal, "SIGALRM") and _main_thread()
  if use_alarm:
    old = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      rc = main(argv)
  except SystemExit as e:  # argparse errors
    rc = e.code if isinstance(e.code, int) else 2
  except _Timeout as e:
    exc = e
  except BaseException as e:  # noqa: BLE001 - anything escaping the CLI is a crash
    exc = e
  finally:
    if use_alarm:
      signal.setitimer(signal.ITIMER_REAL, 0)
      signal.signal(signal.SIGALRM, old)
  return rc, out.getvalue(), err.getvalue(), exc


def _main_thread() -> bool:
  import threading
  return threading.current_thread() is threading.main_thread()


def _raise_timeout(*_):
  raise _Timeout("time limit")


def classify(rc, out: str, err: str, exc, ok: Callable = None) -> Outcome:
  """Outcome of one CLI run. ``ok(out, err)`` checks a successful run's result (None: success is not expected
  to happen, so a success is 'silent')."""
  if isinstance(exc, _Timeout):
    return Outcome("hang", "no result within the time limit")
  if exc is not None:
    return Outcome("crash", f"{type(exc).__name__}: {str(exc)[:200]}")
  if "Traceback (most recent call last)" in err:
    return Outcome("crash", err.strip().splitlines()[-1][:200])
  if rc == 0:
    if ok is not None and ok(out, err):
      return Outcome("recovered", _last(err))
    return Outcome("silent", f"exit 0 but the result is wrong or unchecked: {_last(out)[:120]}")
  lines = [ln for ln in err.strip().splitlines() if ln.strip()]
  errors = [ln for ln in lines if re.match(r"^(error: |[\w.]+: error: )", ln)]
  usage = all(ln.startswith(("usage:", " ", "error:", "warning:")) or re.match(r"^[\w.]+: error: ", ln)
              for ln in lines)
  if len(errors) == 1 and usage and FIX_WORDS.search(errors[0]):
    return Outcome("clear_error", errors[0][:300])
  return Outcome("unclear_error", " | ".join(lines[-3:])[:300])


def _last(s: str) -> str:
  lines = [ln for ln in s.strip().splitlines() if ln.strip()]
  return lines[-1][:300] if lines else ""


def run_cli(module: str, argv: list, ok: Callable = None, timeout_s: float = 120.0) -> Outcome:
  import importlib
  main = importlib.import_module(module).main
  t0 = time.perf_counter()
  o = classify(*invoke(main, argv, timeout_s), ok=ok)
  o.seconds = time.perf_counter() - t0
  return o


def run_case(c: Case, ws: Workspace) -> Outcome:
  t0 = time.perf_counter()
  try:
    o = c.fn(ws)
  except _Timeout:
    o = Outcome("hang", "no result within the time limit")
  except Exception as e:  # noqa: BLE001 - a case whose harness part fails is reported, not hidden
    o = Outcome("crash", f"{type(e).__name__}: {str(e)[:200]}")
  o.seconds = time.perf_counter() - t0
  return o


def summarise(results: dict) -> dict:
  kinds = [r["kind"] for r in results.values()]
  return {"bad_inputs_tried": len(kinds), "recovered": kinds.count("recovered"),
          "clear_errors": kinds.count("clear_error"), "unclear_errors": kinds.count("unclear_error"),
          "crashes": kinds.count("crash"), "hangs": kinds.count("hang"), "silent": kinds.count("silent"),
          "data_lost": sum(bool(r["data_lost"]) for r in results.values())}


def fresh_copy(src: str, dst: str) -> str:
  shutil.copyfile(src, dst)
  return dst
