"""Compiled step: (config, mesh) -> an object that runs, and lowers on abstract inputs.

Training runs it; the performance model and emulation call ``.lower()`` at any mesh size without
allocating; resilience wraps it. :func:`build_step` only picks the form:

* ``mesh.form='jit'`` (parallelism/jit_step.py): GSPMD partitions the pure step from the logical-axis rules;
* ``mesh.form='shard_map'``, and any ``pipeline > 1`` (parallelism/shard_map_step.py): the same step written
  per device with explicit collectives, and the pipeline schedules (parallelism/pipeline.py).

Both return a :class:`~parallelism.compiled.CompiledStep` (parallelism/compiled.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

from jax.sharding import Mesh

from framework.config import Config
from parallelism import jit_step, shard_map_step
from parallelism.compiled import BATCH_SPEC, CompiledStep
from parallelism.mesh import make_mesh

# What callers import from here: the builder, the type it returns, and the batch's layout.
__all__ = ["BATCH_SPEC", "CompiledStep", "build_on_devices", "build_step"]


def build_step(cfg: Config, mesh: Mesh, donate: bool = True) -> CompiledStep:
  """The step of ``cfg`` (a validated config) on ``mesh`` (``parallelism.mesh.make_mesh(cfg.mesh)``).
  ``donate=False`` keeps the input state alive after a step (a caller that still reads it)."""
  if cfg.mesh.form == "shard_map" or cfg.mesh.pipeline > 1:
    return shard_map_step.build(cfg, mesh, donate=donate)
  return jit_step.build(cfg, mesh, donate=donate)


def build_on_devices(cfg: Config, devices: Optional[Sequence] = None, donate: bool = True) -> CompiledStep:
  """:func:`build_step` on a mesh of ``devices`` (default: all of them) shaped by ``cfg.mesh``."""
  return build_step(cfg, make_mesh(cfg.mesh, devices), donate=donate)
