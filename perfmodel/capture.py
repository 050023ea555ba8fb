"""Capture: experiment config -> the real compiled per-device program(s), without allocating.

Training lowers ``parallelism.step.build_step(cfg, mesh).lower()`` — the very step
``python -m experiments.run`` runs — on abstract inputs and compiles it for the host's (virtual)
devices. Inference lowers the KV-cached sampler ``framework.sampling.generate`` on abstract params:
the code before its decode loop is the prefill (TTFT), the loop body one decode step (TPOT).

Virtual CPU devices must exist before jax starts: ``ensure_devices(n)`` sets
``--xla_force_host_platform_device_count`` when jax is not yet initialised and otherwise explains
how to get them.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time

from framework.config import Config


def ensure_devices(n: int) -> None:
  """Asks XLA for >= n host devices if the backend is not up yet (call before any jax use)."""
  flags = os.environ.get("XLA_FLAGS", "")
  m = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
  if m and int(m.group(1)) >= n:
    return
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
  os.environ["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={n}").strip()


def _devices(n: int):
  import jax
  devs = jax.devices()
  if len(devs) < n:
    raise RuntimeError(
        f"the layout needs {n} devices but jax has {len(devs)}: run in a fresh process with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={n} (the perfmodel CLI does this itself)")
  return devs[:n]


@dataclasses.dataclass
class Captured:
  hlo_text: str
  memory: dict  # memory_analysis fields (per device)
  cost_analysis: dict  # XLA's own (loop bodies counted once)
  n_devices: int
  lower_s: float
  compile_s: float
  jaxpr_eqns: int = 0
  compiled: object = None  # the jax Compiled object (runnable on the host when small)


def memory_of(compiled) -> dict:
  """Per-device memory of a compiled program, with the peak as argument + output - alias + temp."""
  m = compiled.memory_analysis()
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
          "generated_code_size_in_bytes")
  out = {k: int(getattr(m, k, 0) or 0) for k in keys}
  # CPU's own 'peak' ignores temp; argument + output - alias + temp is the live set at the peak.
  out["peak_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"] - out["alias_size_in_bytes"]
                       + out["temp_size_in_bytes"])
  return out


def _cost(compiled) -> dict:
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  return {k: float(v) for k, v in (ca or {}).items() if k in ("flops", "bytes accessed", "transcendentals")}


def mesh_for(cfg: Config):
  from parallelism.mesh import make_mesh
  n = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor * cfg.mesh.sequence * cfg.mesh.pipeline
  return make_mesh(cfg.mesh, _devices(n))


def train_step(cfg: Config, keep_compiled: bool = False) -> Captured:
  """Compiles the training step of a validated config (mesh resolved) for its mesh."""
  from parallelism.step import build_step
  mesh = mesh_for(cfg)
  step = build_step(cfg, mesh)
  t0 = time.perf_counter()
  lowered = step.lower()
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return Captured(hlo_text=compiled.as_text(), memory=memory_of(compiled), cost_analysis=_cost(compiled),
                  n_devices=mesh.size, lower_s=t1 - t0, compile_s=t2 - t1,
                  compiled=(compiled, step) if keep_compiled else None)


def sampler(cfg: Config, batch: int, prompt_len: int, gen_len: int, keep_compiled: bool = False) -> Captured:
  """Compiles framework.sampling.generate for (batch, prompt_len, gen_len) on one device."""
  import jax
  import jax.numpy as jnp
  from framework import model as model_lib
  from framework import sampling
  model = model_lib.build(cfg.model)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        __import__("flax").linen.unbox(model_lib.abstract_params(model)))
  prompt = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  t0 = time.perf_counter()
  lowered = sampling.generate.lower(params, prompt, rng, model=model, max_new=gen_len, temperature=0.0)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return Captured(hlo_text=compiled.as_text(), memory=memory_of(compiled), cost_analysis=_cost(compiled),
                  n_devices=1, lower_s=t1 - t0, compile_s=t2 - t1,
                  compiled=(compiled, model) if keep_compiled else None)
