"""Layouts the explicit forms cannot run fail before compiling, naming the fix."""
import pytest

from framework.config import ConfigError
from tests.parallelism import harness


def test_jit_pipeline_with_two_other_axes_names_shard_map():
  with pytest.raises(ConfigError, match="form=shard_map"):
    harness.build({"pipeline": 2, "data": 2, "tensor": 2, "microbatches": 2}, "jit")


def test_pipeline_needs_scanned_layers():
  with pytest.raises(ConfigError, match="scan_layers=True"):
    harness.build({"pipeline": 2, "data": 4, "microbatches": 2}, "shard_map", {"scan_layers": False})
