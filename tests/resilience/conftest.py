import pytest

from tests.resilience.harness import run_job


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, cache_dir):
  """Failure-free run of the test config (also warms the compilation cache for the others)."""
  wd = tmp_path_factory.mktemp("reference")
  return wd, run_job(wd, cache_dir)
