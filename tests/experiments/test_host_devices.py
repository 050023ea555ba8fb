"""experiments.run asks XLA for exactly the config's mesh size of virtual CPU devices (idle ones slow a one-device
step down 1.2-1.5x), 8 when an axis is -1, or what --host-devices says."""
import pytest

from experiments import run
from framework.config import ConfigError

QUICKSTART = "experiments/configs/quickstart.py"


@pytest.mark.parametrize("extra, want", [
    ([], 8),  # quickstart: data=2 x tensor=4
    (["--config.mesh.data=1", "--config.mesh.tensor=1"], 1),
    (["--config.mesh.data=1", "--config.mesh.tensor=2"], 2),
    (["--config.mesh.data=-1"], run.DEFAULT_HOST_DEVICES),
    (["--host-devices", "4", "--config.mesh.data=1", "--config.mesh.tensor=1"], 4),
])
def test_host_devices_default_to_the_mesh_size(monkeypatch, extra, want):
  monkeypatch.chdir(run.__file__.rsplit("/experiments/", 1)[0])
  args, overrides = run.parse(["--config", QUICKSTART, "--workdir", "/tmp/unused", *extra])
  assert run.host_devices(args, overrides) == want


def test_a_bad_override_is_a_config_error_before_jax_starts(monkeypatch):
  monkeypatch.chdir(run.__file__.rsplit("/experiments/", 1)[0])
  args, overrides = run.parse(["--config", QUICKSTART, "--workdir", "/tmp/unused", "--config.mesh.nope=2"])
  with pytest.raises(ConfigError):
    run.host_devices(args, overrides)
