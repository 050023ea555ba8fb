"""Test set-up: 8 emulated CPU devices, set before jax is imported anywhere."""
import os

from framework import xla_flags

xla_flags.set_host_device_count(8, keep_existing=True)  # a count already in XLA_FLAGS (set on purpose) wins
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def skip_if_not_enough_devices(n: int):
  return pytest.mark.skipif(jax.device_count() < n, reason=f"needs {n} devices, have {jax.device_count()}")
