import pytest

from tests.framework.tiny import use_compilation_cache


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
  use_compilation_cache(str(tmp_path_factory.getbasetemp() / "xla_cache"))  # one per session
