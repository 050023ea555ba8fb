"""framework/xla_flags.py: the host device count is written once, other XLA flags are kept."""
import pytest

from framework import xla_flags


def test_adds_the_count_and_keeps_other_flags():
  assert xla_flags.with_host_device_count(4) == "--xla_force_host_platform_device_count=4"
  got = xla_flags.with_host_device_count(2, "--xla_cpu_multi_thread_eigen=false --xla_dump_to=/tmp/d")
  assert got == "--xla_cpu_multi_thread_eigen=false --xla_dump_to=/tmp/d --xla_force_host_platform_device_count=2"


def test_replaces_a_count_instead_of_appending_a_second():
  flags = "--a=1 --xla_force_host_platform_device_count=8 --b=2"
  got = xla_flags.with_host_device_count(3, flags)
  assert got.split() == ["--a=1", "--b=2", "--xla_force_host_platform_device_count=3"]
  assert xla_flags.host_device_count({"XLA_FLAGS": got}) == 3


def test_set_writes_the_given_environment_only():
  env = {"XLA_FLAGS": "--a=1"}
  assert xla_flags.set_host_device_count(6, env) is env
  assert env["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=6"
  empty = {}
  xla_flags.set_host_device_count(1, empty)
  assert empty == {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def test_keep_existing_leaves_a_count_set_on_purpose():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  xla_flags.set_host_device_count(8, env, keep_existing=True)
  assert xla_flags.host_device_count(env) == 2
  env = {"XLA_FLAGS": "--a=1"}  # other flags but no count: the count is added
  xla_flags.set_host_device_count(8, env, keep_existing=True)
  assert env["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=8"


def test_reads_none_when_no_count_is_asked_for():
  assert xla_flags.host_device_count({}) is None
  assert xla_flags.host_device_count({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}) is None


@pytest.mark.parametrize("n", [0, -1])
def test_rejects_a_count_below_one(n):
  with pytest.raises(ValueError, match="must be >= 1"):
    xla_flags.with_host_device_count(n)
