import os
import tempfile

import pytest

from tests.resilience.jobs import run_job


@pytest.fixture(scope="session")
def cache_dir():
  """Persistent XLA cache shared across test sessions (keys are HLO hashes, so code changes just miss):
  a cold compile of 4 processes on a loaded 2-core host costs minutes."""
  d = os.path.join(tempfile.gettempdir(), "prismllm-test-cache", "resilience")
  os.makedirs(d, exist_ok=True)
  return d


@pytest.fixture(scope="session")
def reference(tmp_path_factory, cache_dir):
  """Failure-free run of the test config (also warms the compilation cache for the others)."""
  wd = tmp_path_factory.mktemp("reference")
  return wd, run_job(wd, cache_dir)
