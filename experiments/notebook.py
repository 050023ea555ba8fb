"""What the notebooks in experiments/notebooks/ share: their install step and a layout for the devices jax sees.

Install (:func:`setup`, called by every notebook's first cell): the cell finds the repository (walking up from the
notebook, or cloning ``$PRISMLLM_REPO`` on Colab), puts it on ``sys.path`` and imports this module, which needs only
the standard library, so it runs before PrismLLM is installed. :func:`setup` then pip-installs the repository with
the extra of the runtime (:data:`EXTRAS`: none on CPU, ``[gpu]`` on a GPU, ``[tpu]`` on a TPU) when a dependency or
the runtime's jax plugin is missing, or jax is outside setup.cfg's range. An accelerator runtime therefore never gets
a jax without its plugin (a CPU-only jax in the tested range), only the extra's matching pair. Nothing here imports
jax: XLA reads XLA_FLAGS (the emulated CPU device count) when it starts.

Layout: a notebook runs on whatever the runtime has (8 emulated CPU devices, one GPU, a TPU v2-8 / v5e-8), so its
mesh comes from the device count instead of a config's fixed layout.
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import math
import os
import subprocess
import sys
from typing import Optional

JAX_RANGE = ((0, 10, 2), (0, 11))  # setup.cfg: jax>=0.10.2,<0.11 (tests/experiments/test_notebooks.py keeps them equal)
EXTRAS = {"cpu": "", "gpu": "gpu", "tpu": "tpu"}  # setup.cfg's extras per runtime
# What a bare runtime lacks (the cwd is on sys.path: "framework" alone proves nothing), and per accelerator the
# module its extra installs next to jax (without it jax runs on the CPU only)
NEEDED = ("framework", "flax", "optax", "orbax", "ml_collections", "gguf", "numba", "tensorboardX")
PLUGIN = {"gpu": "jax_cuda12_plugin", "tpu": "libtpu"}
_TPU_ENV = ("COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE")
_TPU_NODES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
_GPU_NODES = ("/dev/nvidia[0-9]*",)


def runtime() -> str:
  """``tpu``, ``gpu`` or ``cpu``: what the machine has attached, from its device nodes and TPU environment
  (Colab sets ``COLAB_TPU_ADDR`` on its TPU runtimes), without starting jax."""
  if any(os.environ.get(k) for k in _TPU_ENV) or any(glob.glob(p) for p in _TPU_NODES):
    return "tpu"
  if any(glob.glob(p) for p in _GPU_NODES):
    return "gpu"
  return "cpu"


def jax_version() -> Optional[tuple]:
  """The installed jax's (major, minor, patch), None without jax."""
  if importlib.util.find_spec("jax") is None:
    return None
  return tuple(int(x) for x in importlib.metadata.version("jax").split(".")[:3] if x.isdigit())


def missing(rt: str) -> list:
  """The modules of :data:`NEEDED` (and the runtime's jax plugin) that are not importable."""
  return [m for m in NEEDED + ((PLUGIN[rt],) if rt in PLUGIN else ()) if importlib.util.find_spec(m) is None]


def install_command(root, rt: str, jax: Optional[tuple], absent: list) -> Optional[list]:
  """The pip command that makes ``root`` usable on runtime ``rt`` (None: it is already): ``pip install -e
  root[extra]`` with the runtime's extra, so on a GPU or TPU jax changes only together with its plugin."""
  if rt not in EXTRAS:
    raise ValueError(f"unknown runtime {rt!r}; one of {sorted(EXTRAS)}")
  if not absent and jax is not None and JAX_RANGE[0] <= jax < JAX_RANGE[1]:
    return None
  extra = EXTRAS[rt]
  return [sys.executable, "-m", "pip", "install", "-q", "-e", f"{root}[{extra}]" if extra else str(root)]


def setup(root) -> Optional[list]:
  """Installs what the runtime lacks (:func:`install_command`) and puts ``root`` on ``sys.path`` (an editable
  install is importable only from the next kernel start). Returns the command it ran, None when nothing was."""
  rt = runtime()
  cmd = install_command(root, rt, jax_version(), missing(rt))
  if cmd is not None:
    print(f"installing PrismLLM for a {rt} runtime:", " ".join(cmd[3:]))
    subprocess.run(cmd, check=True)
  if str(root) not in sys.path:
    sys.path.insert(0, str(root))
  return cmd


def layout(n_devices: int, heads: int, batch: int) -> dict:
  """A data x tensor mesh over all ``n_devices``: tensor as wide as both the device count and the model's
  (KV) heads allow, data the rest. 8 devices, 4 heads -> data=2 x tensor=4; one GPU -> 1 x 1."""
  if n_devices < 1 or heads < 1:
    raise ValueError(f"need at least one device and one head, got {n_devices} devices, {heads} heads")
  tensor = math.gcd(n_devices, heads)
  data = n_devices // tensor
  if batch % data:
    raise ValueError(f"global batch {batch} does not split over data={data} ({n_devices} devices, tensor={tensor}): "
                     f"set a global batch that is a multiple of {data}")
  return {"data": data, "tensor": tensor}


def overrides(mesh: dict) -> list:
  """``--config.mesh.*`` overrides setting every axis of ``mesh`` (the others stay as the config has them)."""
  return [f"--config.mesh.{axis}={size}" for axis, size in mesh.items()]
