"""The ondevice area of the campaign: GGUF files, generation limits and the trained context, plans, ring peers,
the server, export. Its cases (``ondevice_cases.py``, ``run_cases.py``, ``serve_cases.py``) run the real CLIs
(``ondevice.run`` / ``ondevice.export`` / ``ondevice.serve``) in this process, or in a subprocess where a device
process is killed; a refusal is exactly one ``error: ...`` line naming a fix among usage / warning lines. The
case modules register into ``CASES``; ``campaign.load_cases("ondevice")`` imports them.
"""
from __future__ import annotations

import importlib
import os
import re
import shutil
import struct
import time
from typing import Callable, Optional

from benchmarks.reliability import harness
from benchmarks.reliability.harness import Outcome, Run  # noqa: F401 - the cases' names
from ondevice.gguf_io import random_arrays, tiny_config

AREA = "ondevice"
CASES = harness.Registry(AREA, timeout_s=120.0)
case = CASES.case
REFUSAL = harness.Refusal(
    line=re.compile(r"^(error: |[\w.]+: error: )"),
    fix=re.compile(r"re-export|re-copy|pass |raise |lower |rerun|fix |remove |give |add |use |run it with|"
                   r"export |choose |shorten|drop |free |pick ", re.I),
    only_usage=True)


def classify(r: Run, ok: Optional[Callable[[Run], bool]] = None) -> Outcome:
  return harness.classify(r, REFUSAL, ok)


class Workspace(harness.Workspace):
  """Good files the cases start from (our Q4_0 / Q8_0 exports of one random tiny model, a smaller draft, an
  8-layer model for ring cases), in ``root``; corrupted copies are made next to them."""

  def __init__(self, root: str, cache_dir: Optional[str] = None):
    from ondevice.gguf_io import write_arrays  # noqa: PLC0415
    super().__init__(root, cache_dir)
    self.cfg = tiny_config()
    self.arrays = random_arrays(self.cfg)
    self.good = self.make("good-q4_0.gguf", lambda p: write_arrays(self.arrays, self.cfg, p, "q4_0"))
    self.good_q8 = self.make("good-q8_0.gguf", lambda p: write_arrays(self.arrays, self.cfg, p, "q8_0"))
    dcfg = tiny_config(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64)
    self.draft = self.make("draft-q8_0.gguf", lambda p: write_arrays(random_arrays(dcfg, 1), dcfg, p, "q8_0"))
    rcfg = tiny_config(n_layers=8, d_model=128)
    self.ring_model = self.make("ring-q8_0.gguf", lambda p: write_arrays(random_arrays(rcfg, 2), rcfg, p, "q8_0"))
    self._warm()

  def _warm(self) -> None:
    """Compiles the engine's kernels into their on-disk cache once, before any case runs: the first compile takes
    minutes on a loaded 2-core host, which would otherwise land inside the first case's time limit."""
    marker = self.path("engine-warm")
    if os.path.exists(marker):
      return
    for model in (self.good, self.good_q8):
      r = invoke("ondevice.run", ["--model", model, "--prompt", "def f(x):", "--max-tokens", "2", "--greedy"],
                 timeout_s=900.0)
      if r.rc != 0 or r.exc is not None:
        return  # the cases report what fails
    with open(marker, "w"):
      pass

  def make(self, name, write):
    p = self.path(name)
    if not os.path.exists(p):
      write(p)
    return p

  def copy_with(self, name: str, mutate: Callable, src: str = None) -> str:
    with open(src or self.good, "rb") as f:
      data = mutate(bytearray(f.read()))
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
  from gguf import GGUFReader  # noqa: PLC0415
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


def fresh_copy(src: str, dst: str) -> str:
  shutil.copyfile(src, dst)
  return dst


# ------------------------------------------------------------------------------------------ running

def invoke(module: str, argv: list, timeout_s: float = 120.0) -> Run:
  """``module.main(argv)`` in this process (harness.invoke)."""
  return harness.invoke(importlib.import_module(module).main, argv, timeout_s)


def run_cli(module: str, argv: list, ok: Optional[Callable[[str, str], bool]] = None,
            timeout_s: float = 120.0) -> Outcome:
  """Runs ``module``'s CLI in this process and classifies it; ``ok(stdout, stderr)`` checks a success."""
  t0 = time.perf_counter()
  o = classify(invoke(module, argv, timeout_s), ok=None if ok is None else lambda r: ok(r.out, r.err))
  o.seconds = time.perf_counter() - t0
  return o
