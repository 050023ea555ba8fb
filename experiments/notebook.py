"""What the notebooks in experiments/notebooks/ share: a layout for the devices jax sees.

A notebook runs on whatever the runtime has (8 emulated CPU devices, one GPU, a TPU v2-8 / v5e-8), so its mesh
comes from the device count instead of a config's fixed layout.
"""
from __future__ import annotations

import math


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
