"""The figure registry: one entry per headline paper figure, drawn from committed data only.

API (the whole of it):

    from experiments.figures.registry import MissingData, data_path, figure

    @figure("charon_search",                          # unique NAME; `--only NAME`, `--rerun NAME`
            paper="Charon",                           # PrismLLM | Charon | PHOENIX | prima.cpp
            data=["benchmarks/data/x.json"],          # committed inputs, relative to the repository root
            rerun="python -m perfmodel search ...",   # the shell command (run from the repository root, with
                                                      # PYTHONPATH=.) that re-measures the data at this host's scale
            paper_number="+275% throughput",          # what the paper reports, as text
            out="benchmarks/figures/charon_search.png")  # default: benchmarks/figures/NAME.png
    def draw(out_path: str) -> dict:
      ...  # read the data files, save a PNG to out_path
      return {"ours": f"{speedup:+.0f}% measured"}     # our number, as text, computed from the data

Read inputs through `data_path("benchmarks/data/x.json")`: it returns the absolute path, or raises
`MissingData` naming the figure's rerun command when the file is absent (raise `MissingData(msg)` yourself for
any other missing input); the runner prints that one line and goes on with the other figures.
`python -m experiments.figures` imports every module of this package (`discover()`), so a module registers just by
being in the package. Draw functions must stay fast (the whole set runs in under 2 minutes on 2 CPU cores): they
read data, they never measure.
"""
import dataclasses
import importlib
import os
import pkgutil
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIGURES: dict = {}  # name -> Figure, in registration order


class MissingData(Exception):
  """An input file is absent; the message names the command that produces it."""


@dataclasses.dataclass
class Figure:
  name: str
  paper: str
  draw: Callable[[str], dict]
  out: str
  data: list
  rerun: str
  paper_number: str
  module: str

  def data_paths(self) -> list:
    return [os.path.join(ROOT, p) for p in self.data]


def figure(name: str, paper: str, data=(), rerun: str = "", paper_number: str = "", out: str = ""):
  """Registers the decorated `draw(out_path) -> {"ours": str, ...}` under `name`."""
  def wrap(fn):
    if name in FIGURES and FIGURES[name].draw.__module__ != fn.__module__:
      raise ValueError(f"figure {name!r} is registered twice ({FIGURES[name].module} and {fn.__module__})")
    FIGURES[name] = Figure(name, paper, fn, out or f"benchmarks/figures/{name}.png", list(data), rerun,
                           paper_number, fn.__module__)
    return fn
  return wrap


def data_path(rel: str) -> str:
  """Absolute path of a committed data file; raises MissingData when it is absent."""
  p = os.path.join(ROOT, rel)
  if not os.path.exists(p):
    fig = next((f for f in FIGURES.values() if rel in f.data), None)
    hint = f"; run `{fig.rerun}` to produce it" if fig and fig.rerun else ""
    raise MissingData(f"{rel} is missing{hint}")
  return p


SKIP = {"__main__", "registry"}


def discover() -> dict:
  """Imports every module of this package (each registers its figures) and returns FIGURES."""
  pkg = __name__.rpartition(".")[0]
  for m in pkgutil.iter_modules([os.path.dirname(os.path.abspath(__file__))]):
    if m.name not in SKIP:
      importlib.import_module(f"{pkg}.{m.name}")
  return FIGURES
