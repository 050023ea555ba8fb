"""Every dependency setup.cfg installs is imported by the project's code and explained in the README's table; an
unused one (a solver nothing calls) goes."""
import ast
import configparser
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = ("framework", "parallelism", "perfmodel", "resilience", "ondevice", "experiments", "benchmarks")
# distribution name -> the module it provides, where they differ
MODULE = {"orbax-checkpoint": "orbax", "ml-collections": "ml_collections", "pyzmq": "zmq", "pyyaml": "yaml"}


def _requirements() -> list:
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, "setup.cfg"))
  lines = [ln.strip() for ln in cfg["options"]["install_requires"].splitlines()]
  return [re.split(r"[<>=\[ ]", ln)[0] for ln in lines if ln and not ln.startswith("#")]


def _imported() -> set:
  out = set()
  for top in FLOORS:
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
      for f in files:
        if f.endswith(".py"):
          with open(os.path.join(dirpath, f)) as fh:
            tree = ast.parse(fh.read())
          for node in ast.walk(tree):
            if isinstance(node, ast.Import):
              out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
              out.add(node.module.split(".")[0])
  return out


def test_every_dependency_is_imported_by_the_code():
  reqs = _requirements()
  assert "jax" in reqs and len(reqs) > 10  # the parser read the list
  imported = _imported()
  unused = [r for r in reqs if MODULE.get(r, r) not in imported]
  assert not unused, f"setup.cfg installs {unused}, which no module imports: remove them (or import them)"


def test_every_dependency_is_explained_in_the_readme():
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  table = text[text.index("## Dependencies and why each is there"):text.index("## Files outside the repository")]
  named = set(re.findall(r"`([A-Za-z][\w.-]*)", table))
  missing = [r for r in _requirements() if r not in named]
  assert not missing, f"README.md's dependency table does not say why {missing} are installed"
