"""XLA's CPU device count: the one place ``--xla_force_host_platform_device_count`` is written.

XLA reads ``XLA_FLAGS`` once, when jax starts its CPU backend, so the count must be in the environment before
then: in this process (:func:`set_host_device_count` before ``import jax`` does any work) or in a child's
environment (:func:`with_host_device_count`). Other flags in ``XLA_FLAGS`` are kept.
"""
from __future__ import annotations

import os
import re
from typing import MutableMapping, Optional

FLAG = "--xla_force_host_platform_device_count"
_RE = re.compile(FLAG + r"=\d+")


def host_device_count(env: Optional[MutableMapping] = None) -> Optional[int]:
  """The count ``env`` (default: this process's environment) asks XLA for; None when it asks for none."""
  m = re.search(FLAG + r"=(\d+)", (os.environ if env is None else env).get("XLA_FLAGS", ""))
  return int(m.group(1)) if m else None


def with_host_device_count(n: int, flags: str = "") -> str:
  """``flags`` (an ``XLA_FLAGS`` value) asking for exactly ``n`` CPU devices, its other flags kept."""
  if int(n) < 1:
    raise ValueError(f"host device count must be >= 1, got {n}")
  rest = _RE.sub("", flags).split()
  return " ".join(rest + [f"{FLAG}={int(n)}"])


def set_host_device_count(n: int, env: Optional[MutableMapping] = None, keep_existing: bool = False):
  """Writes the count into ``env`` (default ``os.environ``); returns ``env``. ``keep_existing``: leave a count
  that is already there (a caller that set XLA_FLAGS on purpose wins)."""
  env = os.environ if env is None else env
  if keep_existing and host_device_count(env) is not None:
    return env
  env["XLA_FLAGS"] = with_host_device_count(n, env.get("XLA_FLAGS", ""))
  return env
