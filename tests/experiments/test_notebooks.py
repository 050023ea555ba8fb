"""Executes every notebook in experiments/notebooks/ end to end with nbclient (a real ipykernel), in its small
default variant on CPU, and checks what each one claims to show.

The kernel starts in experiments/notebooks/ (where Jupyter opens a notebook): the first cell has to find the
repository by walking up and change into it. PYTHONPATH names the repository, so PrismLLM is importable and the
cell's `pip install -e` branch is not taken there (the test does not install into the environment it runs in).
That branch, and the Colab clone, are checked by running the cell with `subprocess.run` recording the commands;
the choice of pip extra per runtime (experiments/notebook.py) by calling it with the runtime detection mocked.
"""
import fnmatch
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from experiments import notebook as nb_lib
from framework import config_file

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = pathlib.Path(__file__).resolve().parents[2]
FOLDER = REPO / "experiments" / "notebooks"
NAMES = ["quickstart", "emulate", "perfmodel", "hotswap", "ondevice"]
CELL_TIMEOUT_S = 300  # per cell; nbclient interrupts, then shuts the kernel down, on timeout


def _code(nb):
  return [c for c in nb.cells if c.cell_type == "code"]


def _text(nb) -> str:
  return "".join(o.get("text", "") for c in _code(nb) for o in c.get("outputs", []) if o.get("output_type") == "stream")


def _plugins_present() -> bool:
  return all(importlib.util.find_spec(m) is not None for m in ("libtpu", "jax_plugins.xla_cuda12"))


def test_every_notebook_is_tested():
  assert sorted(p.stem for p in FOLDER.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_clean_and_installs_first(name):
  nb = nbformat.read(FOLDER / f"{name}.ipynb", as_version=4)
  nbformat.validate(nb)
  assert all(not c.get("outputs") and c.get("execution_count") is None for c in _code(nb)), \
      "clear outputs before committing"
  first = _code(nb)[0].source
  # the install cell: finds or clones the repository, lets experiments/notebook.py install what the runtime lacks,
  # and asks for the CPU device count before jax starts (so it must not import jax)
  for needed in ("PRISMLLM_REPO", '"git", "clone"', "notebook.setup(ROOT)", "set_host_device_count(8"):
    assert needed in first, f"{name}: the first code cell lacks {needed!r}"
  assert "import jax" not in first and "pip" not in first.replace("pip extra", "")
  # the repository URL comes from $PRISMLLM_REPO only: no URL written into the cell
  assert re.findall(r"https?://\S+", first) == ["https://...')"], re.findall(r"https?://\S+", first)
  assert "plt.show()" in _code(nb)[-1].source, f"{name}: the last cell draws the figure"


def test_every_notebook_has_the_same_install_cell():
  cells = {name: _code(nbformat.read(FOLDER / f"{name}.ipynb", as_version=4))[0].source for name in NAMES}
  assert len(set(cells.values())) == 1, "the install cells differ: copy quickstart.ipynb's into the others"


def test_jax_range_and_extras_match_setup_cfg():
  text = (REPO / "setup.cfg").read_text()
  (lo, hi), = re.findall(r"^\s+jax>=([\d.]+),<([\d.]+)$", text, re.M)
  assert nb_lib.JAX_RANGE == (tuple(map(int, lo.split("."))), tuple(map(int, hi.split(".")))), \
      "setup.cfg's jax range changed: update experiments/notebook.py JAX_RANGE"
  for rt, extra in nb_lib.EXTRAS.items():  # each accelerator extra pins the same jax range, with its plugin
    if extra:
      assert re.search(rf"^{extra} =\n\s+jax\[\w+\]>={re.escape(lo)},<{re.escape(hi)}$", text, re.M), (rt, extra)


def test_quickstart_text_matches_config():
  steps = config_file.load_configdict(str(REPO / "experiments" / "configs" / "quickstart.py")).train.steps
  local = config_file.load_configdict(str(REPO / "experiments" / "configs" / "quickstart.py") + ":runlocal=True")
  md = "".join(c.source for c in nbformat.read(FOLDER / "quickstart.ipynb", as_version=4).cells
               if c.cell_type == "markdown")
  said = {int(n) for n in re.findall(r"(\d+) steps", md)}
  assert said == {steps, local.train.steps}, f"the text says {said} steps; the config has {steps} (runlocal {local.train.steps})"


@pytest.mark.parametrize("n,heads,batch,want", [(8, 4, 8, {"data": 2, "tensor": 4}), (1, 4, 8, {"data": 1, "tensor": 1}),
                                                (4, 4, 8, {"data": 1, "tensor": 4}), (8, 2, 8, {"data": 4, "tensor": 2})])
def test_layout_follows_the_device_count(n, heads, batch, want):
  assert nb_lib.layout(n, heads, batch) == want
  assert nb_lib.overrides(want) == [f"--config.mesh.data={want['data']}", f"--config.mesh.tensor={want['tensor']}"]


def test_layout_rejects_a_batch_that_does_not_split():
  with pytest.raises(ValueError, match="multiple of 8"):
    nb_lib.layout(16, 2, 12)


def _check_quickstart(nb, workdir):
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) >= 2 and all(math.isfinite(x) for x in losses)
  assert losses[-1] < losses[0], f"loss did not fall: {losses}"
  text = _text(nb)
  assert "8 devices" in text and "mesh: {'data': 2, 'tensor': 4}" in text
  assert "greedy sample from the run:\ndef " in text  # the quickstart's sample prompt
  assert "temperature 0.8, another prompt:\nimport " in text


def _check_emulate(nb, workdir):
  found = re.findall(r"(data=\S+): 4 emulated ranks from 1 real device\(s\), iteration ([\d.]+) ms", _text(nb))
  assert [m for m, _ in found] == ["data=4", "data=2,tensor=2"], _text(nb)[-2000:]
  assert all(float(ms) > 0 for _, ms in found)


def _check_perfmodel(nb, workdir):
  text = _text(nb)
  cpu = re.findall(r"cpu data=(\d) x tensor=(\d): ([\d.]+) ms/step", text)
  assert len(cpu) == 3 and all(float(ms) > 0 for *_, ms in cpu), text[-2000:]
  targets = re.findall(r"(h100|tpu_v5e) x 8, data=2 x tensor=4: ([\d.]+) ms/step \(route target_compile\)", text)
  if _plugins_present():
    assert [t for t, _ in targets] == ["h100", "tpu_v5e"], text[-2000:]
  else:
    assert "compile-only plugins not installed" in text


def _check_hotswap(nb, workdir):
  summary = json.loads((workdir / "hotswap_summary.json").read_text())
  assert summary["failures_injected"] == 1 and len(summary["recoveries"]) == 1
  assert summary["recoveries"][0]["causes"] == ["node lost"]
  losses = [summary["losses"][k] for k in sorted(summary["losses"], key=int)]
  assert len(losses) == 10 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
  assert "recovered: ['node lost']" in _text(nb)


def _check_ondevice(nb, workdir):
  text = _text(nb)
  tpot = dict(re.findall(r"^(.+?): windows .* TPOT ([\d.]+) ms \(emulated\)$", text, re.M))
  assert len(tpot) == 6, text[-2000:]  # 4 devices alone, the exo-like split, Halda
  halda = float(tpot["Halda, pipelined ring"])
  single = min(float(v) for k, v in tpot.items() if k.endswith("alone (mmap)"))
  # the point of the plan on these memory-starved devices (ondevice/README.md): faster than the best device alone
  assert halda < single, tpot


CHECKS = {"quickstart": _check_quickstart, "emulate": _check_emulate, "perfmodel": _check_perfmodel,
          "hotswap": _check_hotswap, "ondevice": _check_ondevice}


@pytest.mark.entry
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes(name, tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  monkeypatch.setenv("PRISMLLM_WORKDIR", str(workdir))
  monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # the notebook asks for its own device count
  nb = nbformat.read(FOLDER / f"{name}.ipynb", as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, startup_timeout=120,
                                   resources={"metadata": {"path": str(FOLDER)}}, shutdown_kernel="immediate")
  t0 = time.perf_counter()
  client.execute()  # raises CellExecutionError (with the traceback) if any cell fails
  elapsed = time.perf_counter() - t0
  figure = [o for o in _code(nb)[-1].get("outputs", []) if o.get("output_type") == "display_data"]
  assert any("image/png" in o.get("data", {}) for o in figure), f"{name}: the last cell drew no figure"
  CHECKS[name](nb, workdir)
  print(f"{name} notebook executed in {elapsed:.1f} s")


class _Calls:
  """subprocess.run stand-in: records each command; `git clone` creates the target folder."""

  def __init__(self):
    self.cmds = []

  def __call__(self, cmd, check=False, **_):
    self.cmds.append(list(cmd))
    if cmd[:2] == ["git", "clone"]:
      pathlib.Path(cmd[-1]).mkdir(parents=True)


def _run_install_cell(monkeypatch, cwd, jax_version="0.10.2", missing=(), repo_url="", runtime="cpu"):
  calls = _Calls()
  real_find = importlib.util.find_spec
  monkeypatch.setattr(subprocess, "run", calls)
  monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m in missing else real_find(m, *a))
  monkeypatch.setattr(importlib.metadata, "version", lambda d: jax_version if d == "jax" else "0")
  monkeypatch.setenv("PRISMLLM_REPO", repo_url)
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.chdir(cwd)  # the cell changes directory; monkeypatch restores it
  monkeypatch.setattr(sys, "path", list(sys.path))
  monkeypatch.setattr(nb_lib, "runtime", lambda: runtime)
  source = _code(nbformat.read(FOLDER / "hotswap.ipynb", as_version=4))[0].source
  namespace = {}
  exec(compile(source, "install-cell", "exec"), namespace)  # noqa: S102 - the notebook's own cell
  return namespace, calls.cmds


def test_install_cell_finds_the_repository_and_installs_nothing_when_ready(monkeypatch):
  ns, cmds = _run_install_cell(monkeypatch, FOLDER)
  assert ns["ROOT"] == REPO and os.getcwd() == str(REPO) and cmds == []
  assert "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]


@pytest.mark.parametrize("jax_version,missing", [("0.11.2", ()), ("0.10.1", ()), ("0.10.2", ("flax",))])
def test_install_cell_installs_the_repository_when_jax_or_a_dependency_is_off(monkeypatch, jax_version, missing):
  _, cmds = _run_install_cell(monkeypatch, FOLDER, jax_version, missing)
  assert cmds == [[sys.executable, "-m", "pip", "install", "-q", "-e", str(REPO)]]


@pytest.mark.parametrize("runtime,extra,plugin", [("gpu", "gpu", "jax_cuda12_plugin"), ("tpu", "tpu", "libtpu")])
def test_install_cell_on_an_accelerator_installs_its_extra(monkeypatch, runtime, extra, plugin):
  # ready for CPU but without the runtime's jax plugin: the extra installs jax's matching pair
  _, cmds = _run_install_cell(monkeypatch, FOLDER, missing=(plugin,), runtime=runtime)
  assert cmds == [[sys.executable, "-m", "pip", "install", "-q", "-e", f"{REPO}[{extra}]"]]
  _, cmds = _run_install_cell(monkeypatch, FOLDER, jax_version="0.11.2", runtime=runtime)  # a newer jax
  assert cmds == [[sys.executable, "-m", "pip", "install", "-q", "-e", f"{REPO}[{extra}]"]]


def test_install_command_never_changes_jax_on_an_accelerator_without_its_extra():
  for rt, extra in nb_lib.EXTRAS.items():
    for jax in (None, (0, 9, 0), (0, 10, 2), (0, 11, 2)):
      for absent in ([], ["flax"]):
        cmd = nb_lib.install_command("/r", rt, jax, absent)
        if jax == (0, 10, 2) and not absent:
          assert cmd is None, (rt, jax, absent)
        else:
          assert cmd[-1] == (f"/r[{extra}]" if extra else "/r"), (rt, cmd)
  with pytest.raises(ValueError, match="unknown runtime"):
    nb_lib.install_command("/r", "rocm", None, [])


@pytest.mark.parametrize("env,nodes,want", [
    ({}, [], "cpu"), ({}, ["/dev/nvidia0"], "gpu"), ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, [], "tpu"),
    ({}, ["/dev/accel0"], "tpu"), ({"TPU_NAME": "v5e"}, ["/dev/nvidia0"], "tpu")])
def test_runtime_detection(monkeypatch, env, nodes, want):
  for k in ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE"):
    monkeypatch.delenv(k, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setattr(nb_lib.glob, "glob", lambda pattern: [n for n in nodes if fnmatch.fnmatch(n, pattern)])
  assert nb_lib.runtime() == want


def test_missing_asks_for_the_runtimes_plugin(monkeypatch):
  monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m in ("libtpu", "jax_cuda12_plugin") else 1)
  assert nb_lib.missing("cpu") == [] and nb_lib.missing("gpu") == ["jax_cuda12_plugin"]
  assert nb_lib.missing("tpu") == ["libtpu"]


def test_install_cell_clones_prismllm_repo_outside_a_checkout(monkeypatch, tmp_path):
  url = "https://example.invalid/prismllm.git"
  ns, cmds = _run_install_cell(monkeypatch, tmp_path, missing=("framework",), repo_url=url)
  clone = tmp_path.resolve() / "prismllm"
  assert cmds == [["git", "clone", "--depth", "1", url, str(clone)],
                  [sys.executable, "-m", "pip", "install", "-q", "-e", str(clone)]]
  assert ns["ROOT"] == clone


def test_install_cell_says_what_to_do_outside_a_checkout_without_a_url(monkeypatch, tmp_path):
  with pytest.raises(RuntimeError, match="set PRISMLLM_REPO"):
    _run_install_cell(monkeypatch, tmp_path, missing=("framework",))
