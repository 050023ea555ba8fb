"""The import graph: no cycles anywhere, and imports only point down the floors.

framework (1) <- parallelism (2) <- perfmodel / resilience / ondevice (3) <- experiments (4) <- benchmarks (5).
Imports inside functions count like any other: moving an import into a function does not remove a dependency.
Inside perfmodel, the prediction core never imports the offline calibration (perfmodel/calib) or the emulator,
and nothing imports the command line.
"""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = {"framework": 1, "parallelism": 2, "perfmodel": 3, "resilience": 3, "ondevice": 3, "experiments": 4,
          "benchmarks": 5}


def _modules() -> dict:
  mods = {}
  for top in FLOORS:
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
          mods[rel[:-9] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
  return mods


def _graph() -> dict:
  mods = _modules()
  edges = {}
  for m, path in mods.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    pkg = m if path.endswith("__init__.py") else m.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = pkg.split(".")
          base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        for a in node.names:  # `from pkg import mod` depends on pkg.mod, `from mod import name` on mod
          targets.append(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
      for t in targets:
        while t and t not in mods:
          t = t.rpartition(".")[0]
        if t and t != m:
          out.add(t)
    edges[m] = out
  return edges


def _floor(m: str) -> int:
  return FLOORS[m.split(".")[0]]


def test_no_import_cycles():
  edges = _graph()
  index, low, stack, on, cycles = {}, {}, [], set(), []

  def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        cycles.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_imports_point_down():
  bad = [f"{m} -> {t}" for m, ts in _graph().items() for t in ts if _floor(t) > _floor(m)]
  bad += [f"{m} -> {t}" for m, ts in _graph().items() for t in ts
          if _floor(t) == _floor(m) == 3 and m.split(".")[0] != t.split(".")[0]]
  assert not bad, "imports pointing up or across floor 3: " + ", ".join(sorted(bad))


def _in(m: str, pkg: str) -> bool:
  return m == pkg or m.startswith(pkg + ".")


def _is_core(m: str) -> bool:
  return _in(m, "perfmodel") and not any(_in(m, p) for p in ("perfmodel.calib", "perfmodel.emulate", "perfmodel.cli",
                                                             "perfmodel.__main__"))


def test_perfmodel_core_is_offline_free():
  edges = _graph()
  if not any(_in(m, "perfmodel.calib") for m in edges):
    pytest.fail("perfmodel/calib/ does not exist: the offline calibration has not been split from the core")
  bad = [f"{m} -> {t}" for m, ts in edges.items() if _is_core(m) for t in ts
         if any(_in(t, p) for p in ("perfmodel.calib", "perfmodel.emulate", "perfmodel.cli"))]
  bad += [f"{m} -> {t}" for m, ts in edges.items() for t in ts if t in ("perfmodel.cli", "perfmodel.emulate.cli")
          and not m.endswith("__main__") and m != "perfmodel.cli"]
  assert not bad, "the perfmodel core imports calibration / emulation / CLI code: " + ", ".join(sorted(bad))


def test_no_module_over_500_lines():
  over = []
  for m, path in _modules().items():
    with open(path) as f:
      n = sum(1 for _ in f)
    if n > 520:
      over.append(f"{m} ({n})")
  assert not over, "modules over ~500 lines: " + ", ".join(over)


def test_perfmodel_core_size():
  total = 0
  for m, path in _modules().items():
    if _is_core(m):
      with open(path) as f:
        total += sum(1 for _ in f)
  # ~5.2k: graph + cost (~2k), the profiler that times a program's instructions alone for the profiled backends
  # (cost/profiler.py, trace_nodes.py, regime.py, ~0.6k: predict runs it, so it is core, not calibration), the one
  # timeline with each framework's overlap rules and the pipeline model (~0.5k), predict / program / target (~1k),
  # hardware, memory, compose, search. Growth past it asks for a split, not a bump.
  assert total <= 5300, f"perfmodel core is {total} lines (budget ~5.2k)"


LIBRARY = ("framework", "parallelism", "perfmodel", "resilience", "ondevice")
CAMPAIGN_MODULE = re.compile(r"^(fault_suite|faults\w*|harness)$")
CAMPAIGN_CLASSES, CAMPAIGN_FUNCTIONS = {"Case", "Outcome"}, {"run_case", "summarise"}


def campaign_code(module: str, source: str) -> list:
  """Why ``module`` (dotted name) with this source is fault-campaign code: a campaign module's name, or a class
  Case / Outcome or a function run_case / summarise defined anywhere in it (the campaign lives in
  benchmarks/reliability/)."""
  why = []
  if CAMPAIGN_MODULE.match(module.rpartition(".")[2]):
    why.append(f"{module}: named like a fault-campaign module")
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ClassDef) and node.name in CAMPAIGN_CLASSES:
      why.append(f"{module}: defines class {node.name}")
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in CAMPAIGN_FUNCTIONS:
      why.append(f"{module}: defines {node.name}()")
  return why


def test_the_campaign_checker_finds_what_it_looks_for():
  assert campaign_code("resilience.faults", "") and campaign_code("ondevice.fault_suite", "")
  assert campaign_code("resilience.faults_lifecycle_cases", "") and campaign_code("parallelism.harness", "")
  assert campaign_code("ondevice.checks", "import dataclasses\n@dataclasses.dataclass\nclass Outcome:\n  kind: str\n")
  assert campaign_code("framework.x", "class Case:\n  pass\n")
  assert campaign_code("perfmodel.x", "def f():\n  def run_case(c, ws):\n    return c\n")
  assert campaign_code("resilience.report", "def summarise(results):\n  return {}\n")
  assert not campaign_code("ondevice.weights", "def io_counters():\n  return {'major_faults': 0}\n")
  assert not campaign_code("resilience.injection", "class Fault:\n  pass\ndef summary():\n  pass\n")


def test_no_fault_campaign_in_the_library():
  """The library packages hold product code only: the fault campaign (cases, outcomes, running and counting
  them) is benchmarks/reliability/."""
  found = []
  for m, path in _modules().items():
    if m.split(".")[0] in LIBRARY:
      with open(path) as f:
        found += campaign_code(m, f.read())
  assert not found, "fault-campaign code in the library (move it to benchmarks/reliability/): " + "; ".join(found)
