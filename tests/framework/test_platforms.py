import os
import subprocess
import sys

from framework import platforms


def test_cpu_only_without_accelerator(monkeypatch):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  for k in platforms._ACCELERATOR_ENV:
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setattr(platforms, "_ACCELERATOR_NODES", ())
  assert platforms.cpu_unless_accelerator()
  assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_explicit_choice_and_accelerators_left_alone(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  assert not platforms.cpu_unless_accelerator()
  assert os.environ["JAX_PLATFORMS"] == "cuda"
  monkeypatch.delenv("JAX_PLATFORMS")
  monkeypatch.setenv("TPU_NAME", "my-tpu")
  assert not platforms.cpu_unless_accelerator()
  assert "JAX_PLATFORMS" not in os.environ


def test_import_of_framework_sets_it_before_jax_starts():
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS",) + platforms._ACCELERATOR_ENV}
  code = "import framework, jax, os; print(os.environ.get('JAX_PLATFORMS'), jax.default_backend())"
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  expected = "cpu cpu" if not platforms.has_accelerator() else None
  if expected:
    assert r.stdout.split() == ["cpu", "cpu"]
    assert "Traceback" not in r.stderr, r.stderr[-1000:]
