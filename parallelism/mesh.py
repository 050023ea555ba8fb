"""Device mesh from config."""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from framework.config import MESH_AXES, MeshConfig, resolve_mesh


def make_mesh(cfg: MeshConfig, devices: Optional[Sequence] = None) -> Mesh:
  """Mesh with axes ('pipeline','data','fsdp','sequence','tensor') in that order (tensor innermost,
  so tensor-parallel groups are neighbouring devices: fastest links on real hardware).
  Axis types are Auto: jax 0.10's make_mesh defaults to Explicit, which rejects sharded gathers."""
  devices = list(devices if devices is not None else jax.devices())
  cfg = resolve_mesh(cfg, len(devices))
  shape = tuple(getattr(cfg, a) for a in MESH_AXES)
  arr = None
  for split in (False, True):  # TPU: an axis of 8 on a 16x16x16 slice splits a physical axis
    try:
      arr = jax.experimental.mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=split)
      break
    except Exception:  # noqa: BLE001 - virtual/odd topologies: plain order is fine
      continue
  if arr is None:
    arr = np.asarray(devices).reshape(shape)
  return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
