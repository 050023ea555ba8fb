"""Host allocator settings for XLA:CPU steps: reuse a step's temporary buffer instead of page-faulting it afresh.

Why: XLA:CPU allocates each execution's temporaries as one buffer with ``malloc`` and frees it when the step
ends. glibc serves a block above its dynamic mmap threshold (at most 32 MiB on 64-bit) with a fresh ``mmap``,
and a thread's own arena cannot grow past 64 MiB, so a step whose temporaries exceed 32 MiB gets new pages
every step and the kernel faults and zeroes every one of them. With the settings below such a step reuses its
pages and takes no page faults; a step with less than 32 MiB of temporaries is not affected. On a virtual
machine the fault cost also moves with the hypervisor's state, independently of compute speed, which makes it
the noisiest part of a CPU step.

The settings: no mmap below 1 GiB, never trim the heap top, one arena for all threads (the main heap grows
past 64 MiB). Freed memory then stays with the process: its resident size stays at its peak, which is what a
training loop reaches every step anyway. Opt out with ``PRISM_HOST_MALLOC=default`` in the environment.

``python -m experiments.run`` applies them before jax starts, and so do the processes that measure for the
performance model and the emulator, so a prediction, an emulation and the real job share one allocator regime.
"""
from __future__ import annotations

import ctypes
import os

ENV = "PRISM_HOST_MALLOC"
# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_state = {"applied": False}


def keep_freed_memory() -> bool:
  """Sets glibc's malloc to keep freed blocks (see the module docstring). True when glibc accepted all three
  settings; False where there is no glibc (the process keeps its default allocator)."""
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    return False
  ok = (bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))
        and bool(libc.mallopt(_M_ARENA_MAX, 1)))
  _state["applied"] = _state["applied"] or ok
  return ok


def apply() -> bool:
  """:func:`keep_freed_memory` unless ``PRISM_HOST_MALLOC=default``. Call before jax starts its threads (the
  arena setting applies to threads that allocate for the first time afterwards)."""
  if os.environ.get(ENV, "").strip().lower() == "default":
    return False
  return keep_freed_memory()


def state() -> str:
  """'keep_freed' once this process applied the settings, else 'default' (recorded with every measurement)."""
  return "keep_freed" if _state["applied"] else "default"
