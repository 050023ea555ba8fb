"""Which jax backends to start: CPU alone on a machine with no accelerator attached.

The ``tpu-aot`` extra installs libtpu and the CUDA plugin so that programs can be *compiled* for TPU and GPU
targets on any host (parallelism/targets.py). Installed, both also try to *start* when jax picks its default
backends: on a host without the hardware, the CUDA plugin logs a traceback and libtpu a page of warnings,
and nothing runs any differently. So when ``JAX_PLATFORMS`` is unset and no accelerator device node exists,
PrismLLM asks jax for CPU only. A machine with a GPU or TPU attached, or any explicit ``JAX_PLATFORMS``, is
left alone. Imported by ``framework/__init__.py``, which every entry point imports before jax starts a backend.
"""
from __future__ import annotations

import glob
import os

ENV = "JAX_PLATFORMS"
# device nodes of NVIDIA GPUs (driver), TPU VMs (accel / vfio) and AMD GPUs (kfd)
_ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd")
_ACCELERATOR_ENV = ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "CUDA_VISIBLE_DEVICES", "COLAB_TPU_ADDR")


def has_accelerator() -> bool:
  if any(os.environ.get(k) for k in _ACCELERATOR_ENV):
    return True
  return any(glob.glob(p) for p in _ACCELERATOR_NODES)


def cpu_unless_accelerator() -> bool:
  """Sets ``JAX_PLATFORMS=cpu`` when it is unset and no accelerator is attached; True when it did."""
  if os.environ.get(ENV) is not None or has_accelerator():
    return False
  os.environ[ENV] = "cpu"
  return True
