"""Hybrid execution, the real half: compile one rank's stand-in program for the local device, run it at
real shapes, time it, and read its compiled memory.

The rank's step is compiled exactly like training compiles it (one ``jax.jit`` with the state donated),
so XLA fuses, schedules and allocates the real per-rank computation; only the collectives are local
stand-ins (perfmodel/emulate/standins.py). Timing is the median of ``repeats`` steps after
``warmup`` steps, each step fed the state the previous one returned (as in training).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Optional

import jax

from perfmodel.emulate import rank_program as rp


@dataclasses.dataclass
class RankRun:
  rank: int
  compile_s: float
  step_times_s: list
  compute_s: float  # median measured step time of the stand-in program (local compute + stand-ins)
  memory: dict  # memory_analysis of the compiled per-rank program
  hlo_text: str
  records: list  # CollectiveRecord
  loss: float
  device: str

  @property
  def noise(self) -> float:
    """(p90 - p10) / median of the timed steps."""
    xs = sorted(self.step_times_s)
    if len(xs) < 3:
      return 0.0
    lo, hi = xs[int(0.1 * (len(xs) - 1))], xs[int(round(0.9 * (len(xs) - 1)))]
    return (hi - lo) / self.compute_s if self.compute_s else 0.0


def memory_of(compiled) -> dict:
  m = compiled.memory_analysis()
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
          "generated_code_size_in_bytes")
  out = {k: int(getattr(m, k, 0) or 0) for k in keys}
  # Same convention as perfmodel.capture: CPU's own 'peak' ignores temporaries.
  out["peak_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"] - out["alias_size_in_bytes"]
                       + out["temp_size_in_bytes"])
  return out


def compile_rank(prog: rp.RankProgram, rank: int):
  """(compiled, interpreter, compile_s): the rank's stand-in step compiled for the default device,
  lowered on abstract per-rank inputs (nothing allocated)."""
  step, interp = rp.rank_step(prog, rank)
  fn = jax.jit(step, donate_argnums=(0,))
  t0 = time.perf_counter()
  compiled = fn.lower(prog.local_state, *prog.local_batch).compile()
  return compiled, interp, time.perf_counter() - t0


def run_rank(prog: rp.RankProgram, rank: int, repeats: int = 5, warmup: int = 1, execute: bool = True,
             seed: int = 0, batch: Optional[tuple] = None, state=None) -> RankRun:
  compiled, interp, compile_s = compile_rank(prog, rank)
  times, loss = [], float("nan")
  if execute:
    state = state if state is not None else rp.random_state(prog, seed)
    inputs, targets = batch if batch is not None else rp.random_batch(prog, seed + 1)
    for i in range(warmup + repeats):
      t0 = time.perf_counter()
      state, l = compiled(state, inputs, targets)
      jax.block_until_ready((state, l))
      if i >= warmup:
        times.append(time.perf_counter() - t0)
    loss = float(l)
    del state
  return RankRun(rank=rank, compile_s=compile_s, step_times_s=times,
                 compute_s=statistics.median(times) if times else float("nan"), memory=memory_of(compiled),
                 hlo_text=compiled.as_text(), records=list(interp.records), loss=loss,
                 device=str(jax.devices()[0].device_kind))
