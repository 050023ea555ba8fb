"""Which jax backends to start (CPU alone on a machine with no accelerator attached), and a quiet start.

The ``tpu-aot`` extra installs libtpu and the CUDA plugin so that programs can be *compiled* for TPU and GPU
targets on any host (parallelism/targets.py). Installed, both also try to *start* when jax picks its default
backends: on a host without the hardware, the CUDA plugin logs a traceback and libtpu a page of warnings,
and nothing runs any differently. So when ``JAX_PLATFORMS`` is unset and no accelerator device node exists,
PrismLLM asks jax for CPU only. A machine with a GPU or TPU attached, or any explicit ``JAX_PLATFORMS``, is
left alone. Imported by ``framework/__init__.py``, which every entry point imports before jax starts a backend.

Quiet start: even with ``JAX_PLATFORMS=cpu``, importing jax loads the CUDA plugin's kernels (``jaxlib.gpu_*``)
and discovering plugins loads the plugin itself; each logs "Could not find cuda drivers on your machine" through
absl before absl is initialised, which writes a second warning line per message. Neither
``TF_CPP_MIN_LOG_LEVEL`` nor jax's settings reach those lines (they come from the plugin's own absl). So
:func:`import_jax` holds stderr while jax imports and discovers its plugins, drops exactly the lines in
``NOISE`` (and only on a machine without an accelerator), and writes every other line back: a real error still
shows. Entry points pass ``verbose=True`` for their ``--verbose`` flag to see everything.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import tempfile

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


# The start-up lines of the CUDA compile-only plugin on a machine with no GPU (nothing else is dropped).
NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
                   r"|[IW]\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine.*)$")


@contextlib.contextmanager
def filtered_stderr(drop=NOISE):
  """Holds everything written to file descriptor 2 (Python's and C libraries') in a temporary file, then writes
  it back without the lines ``drop`` matches."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      kept = [ln for ln in held.read().decode(errors="replace").splitlines(keepends=True)
              if not drop.match(ln.rstrip("\n"))]
      if kept:
        os.write(2, "".join(kept).encode())


def import_jax(verbose: bool = False):
  """Imports jax and registers its plugins, without the compile-only plugins' start-up noise unless ``verbose``
  or an accelerator is attached (where those lines may matter). Starts no backend. Returns the jax module."""
  quiet = not verbose and not has_accelerator()
  with filtered_stderr() if quiet else contextlib.nullcontext():
    import jax  # noqa: PLC0415 (what this function is for: jax imports inside the stderr filter)
    try:
      from jax._src import xla_bridge  # noqa: PLC0415 (jax's plugin discovery, run inside the same filter)
      xla_bridge._discover_and_register_pjrt_plugins()  # noqa: SLF001
    except (ImportError, AttributeError):  # another jax: its first use may print the lines, nothing worse
      pass
  return jax
