"""Executes experiments/notebooks/quickstart.ipynb end to end with nbclient (a real ipykernel).

The kernel runs with the repository root as its working directory (the notebook's config path is
relative to it) and trains into a temporary workdir passed through PRISMLLM_WORKDIR.
"""
import json
import math
import os
import pathlib
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

pytestmark = pytest.mark.entry

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "experiments" / "notebooks" / "quickstart.ipynb"
CELL_TIMEOUT_S = 240  # per cell; nbclient interrupts, then shuts the kernel down, on timeout


def _stream_text(nb) -> str:
  return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                 if o.get("output_type") == "stream")


def test_committed_notebook_has_no_outputs():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "clear outputs before committing"
  first = next(c for c in nb.cells if c.cell_type == "code")
  # XLA_FLAGS must be set before jax is imported, i.e. in the first code cell, which must not import jax.
  assert "set_host_device_count(8" in first.source and "import jax" not in first.source


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
  workdir = tmp_path / "run"
  monkeypatch.setenv("PRISMLLM_WORKDIR", str(workdir))
  monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, startup_timeout=120,
                                   resources={"metadata": {"path": str(REPO)}}, shutdown_kernel="immediate")
  t0 = time.perf_counter()
  client.execute()  # raises CellExecutionError (with the traceback) if any cell fails
  elapsed = time.perf_counter() - t0

  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) >= 2 and all(math.isfinite(x) for x in losses)
  assert losses[-1] < losses[0], f"loss did not fall: {losses}"
  text = _stream_text(nb)
  assert "8 devices" in text
  assert "greedy sample from the run:\ndef " in text  # the quickstart's sample prompt
  assert "temperature 0.8, another prompt:\nimport " in text
  assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
             for o in c.get("outputs", []) if o.get("output_type") == "display_data"), "loss plot missing"
  print(f"notebook executed in {elapsed:.1f} s")
