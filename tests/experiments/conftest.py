import pytest

from tests.framework.tiny import use_compilation_cache


@pytest.fixture(scope="package", autouse=True)
def _compilation_cache(tmp_path_factory):
  """One persistent XLA cache per session for this package's many tiny runs; other packages' tests run
  with jax's settings as they were."""
  restore = use_compilation_cache(str(tmp_path_factory.getbasetemp() / "xla_cache"))
  yield
  restore()
