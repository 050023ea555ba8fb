"""A step's features, and the step time the profile's fitted composition makes of them.

On a host whose N virtual devices run their per-device programs on shared cores (the ``cpu`` profile), a step is not
the makespan of one device's timeline: the devices' node times add up, with a per-thunk gap, a per-device cost and
the in-process collectives between them. ``python -m perfmodel calibrate`` fits how, per program type, as a
:class:`perfmodel.compositions.Composition` over the :class:`perfmodel.compositions.StepFeatures` computed here.
"""
from __future__ import annotations

from typing import Callable, Optional

from perfmodel.compositions import StepFeatures
from perfmodel.cost import collectives
from perfmodel.graph.nodes import COMPUTE_KINDS, ExecGraph

# XLA:CPU combines a program's temporaries into one buffer per execution, allocated with malloc. With glibc's
# default settings, blocks above its largest dynamic mmap threshold (32 MiB on 64-bit) come from a fresh mmap and
# are unmapped on free, so such a step page-faults its whole temp buffer every time (0.4-0.5 ms of system time per
# MiB on a CPU host). The project's processes switch this off (framework/host_memory.py); the fresh-temp term
# prices it for profiles calibrated without.
FRESH_ALLOC_THRESHOLD = 32 * 2 ** 20


def fresh_bytes(temp_bytes: float, n_devices: int, keeps: bool = False) -> float:
  """Bytes a step page-faults afresh: each device's temp buffer when it is above the mmap threshold, none when
  malloc keeps freed blocks (``keeps``)."""
  return float(temp_bytes) * n_devices if temp_bytes > FRESH_ALLOC_THRESHOLD and not keeps else 0.0


def pow2_tokens(cfg) -> bool:
  """Whether a training step's tokens per device (global batch x sequence / data-parallel ways) are a power of
  two. XLA:CPU is shape-specific: in power-of-two programs the same node classes run 1.2-1.65x their physical
  estimate against other programs, which neighbours mostly drawn from other programs do not carry; the
  ``pow2_node_seconds`` term lets the fit learn that scale."""
  ways = max(1, cfg.mesh.data * cfg.mesh.fsdp)
  tokens, rem = divmod(cfg.data.global_batch * cfg.data.seq_len, ways)
  return rem == 0 and tokens > 0 and tokens & (tokens - 1) == 0


def program_type(n_devices: int, decode: bool = False) -> str:
  return "decode" if decode else ("multi" if n_devices > 1 else "train")


def step_features(g: ExecGraph, price: Callable, n_devices: int, region: Optional[str] = None,
                  temp_bytes: float = 0.0, hw=None, keeps: Optional[bool] = None, pow2: bool = False,
                  per_step: bool = True) -> StepFeatures:
  """The features of ``region`` (default: the whole program) with compute nodes priced by ``price(node)``.
  Collectives: with ``hw``, their modelled seconds over every group; else their bytes x N. ``keeps``: whether
  malloc keeps freed blocks (None: as ``hw`` was calibrated). ``per_step`` False: a decode step, which pays no
  per-step constant (the loop does not re-enter the runtime per token)."""
  keeps = (hw is not None and hw.calibration.host_malloc == "keep_freed") if keeps is None else keeps
  t, execs, cb, ce, nb = 0.0, 0, 0.0, 0, 0.0
  for n, k in g.walk(region):
    if n.collective is not None:
      if hw is not None:
        cb += collectives.node_cost(n.collective, hw).seconds * max(1, n.collective.n_groups) * k
      else:
        cb += n.collective.bytes * k * n_devices
      ce += k
    elif n.kind in COMPUTE_KINDS:
      t += price(n) * k
      nb += n.bytes * k
      execs += k
  return StepFeatures(node_seconds=t * n_devices, node_executions=execs * n_devices,
                      devices=n_devices if per_step else 0.0, collective_seconds=cb,
                      collective_executions=ce * n_devices,
                      fresh_temp_bytes=0.0 if region else fresh_bytes(temp_bytes, n_devices, keeps),
                      node_bytes=nb * n_devices, pow2_node_seconds=t * n_devices if pow2 else 0.0)
