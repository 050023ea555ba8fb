"""Hybrid execution, the real half: compile one rank's stand-in program for the local device, run it at
real shapes, time it, and read its compiled memory.

The rank's step is compiled exactly like training compiles it (one ``jax.jit`` with the state donated),
so XLA fuses, schedules and allocates the real per-rank computation; only the collectives are local
stand-ins (perfmodel/emulate/standins.py). Timing is the median of ``repeats`` steps after
``warmup`` steps, each step fed the state the previous one returned (as in training).

What one timed step contains is what ``framework/train.py`` pays per logged step (log_every=1):
this rank's rows of the global batch drawn by the framework's own iterator (``framework.data.iterator``, its
data-parallel position as the process index), put on the device, the step dispatched, and the loss
read back to the host (the loop's one sync). ``host_data=False`` feeds one fixed random batch instead.

Branch counting: a pipelined program decides its ``cond`` branches at run time (idle ticks skip the
forward/backward slot). A second build of the same program whose branches report themselves
(``Interpreter.count_branches``) runs once; the per-site sequence of taken branches tells the
timeline which branch each execution really ran (perfmodel/emulate/timeline.py).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Optional

import jax
import psutil

from framework import data as data_lib
from perfmodel.program import memory_of  # one peak-memory convention for predict and emulate
from perfmodel.cost import trace_nodes as tn
from perfmodel.emulate import rank_program as rp
from perfmodel.emulate.standins import _sub_jaxprs


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
  branch_trace: Optional[dict] = None  # cond site -> taken branch per execution (None: not counted)
  n_cond_sites: int = 0
  host_data: bool = False
  step_cpu_s: list = dataclasses.field(default_factory=list)  # process CPU time of each timed step (all threads)
  node_times: Optional[dict] = None  # HLO instruction -> in-program seconds per execution (TraceMe), if traced
  executed: bool = True  # False: compiled only (asked, or the rank does not fit this host: ``not_run``)
  not_run: str = ""  # why a rank asked to run was only compiled

  @property
  def noise(self) -> float:
    """(p90 - p10) / median of the timed steps."""
    xs = sorted(self.step_times_s)
    if len(xs) < 3:
      return 0.0
    lo, hi = xs[int(0.1 * (len(xs) - 1))], xs[int(round(0.9 * (len(xs) - 1)))]
    return (hi - lo) / self.compute_s if self.compute_s else 0.0


def compile_rank(prog: rp.RankProgram, rank: int):
  """(compiled, interpreter, compile_s): the rank's stand-in step compiled for the default device,
  lowered on abstract per-rank inputs (nothing allocated)."""
  step, interp = rp.rank_step(prog, rank)
  fn = jax.jit(step, donate_argnums=(0,))
  t0 = time.perf_counter()
  compiled = fn.lower(prog.local_state, *prog.local_batch).compile()
  return compiled, interp, time.perf_counter() - t0


def count_branches(prog: rp.RankProgram, rank: int, state, inputs, targets) -> tuple:
  """(branch_trace, n_cond_sites): runs the counting build of the rank's step once (not timed)."""
  step, interp = rp.rank_step(prog, rank)
  interp.count_branches = True
  if not _has_cond(prog.body.jaxpr):
    return {}, 0
  fn = jax.jit(step)
  out = fn(state, inputs, targets)
  jax.block_until_ready(out)
  jax.effects_barrier()
  return {k: list(v) for k, v in interp.branch_trace.items()}, interp.n_conds


def _has_cond(jaxpr) -> bool:
  return any(e.primitive.name == "cond" or any(_has_cond(j) for j in _sub_jaxprs(e.params)) for e in jaxpr.eqns)


def _data_iterator(prog: rp.RankProgram, rank: int):
  """The framework's batch iterator for this rank's rows: process index = its position over the batch axes."""
  cfg = prog.cfg
  axes = [a for a in ("data", "fsdp") if prog.space.axis_sizes.get(a, 1) > 1]
  pc = 1
  for a in axes:
    pc *= prog.space.axis_sizes[a]
  pi = prog.space.position(rank, axes) if axes else 0
  it = data_lib.iterator(data_lib.load(cfg), cfg.data, process_index=pi, process_count=pc)
  seq = prog.space.axis_sizes.get("sequence", 1)
  t_local = prog.local_batch[0].shape[1]
  s_pos = prog.space.coords(rank).get("sequence", 0)

  def nxt():
    b = next(it)
    if seq > 1:
      b = {k: v[:, s_pos * t_local:(s_pos + 1) * t_local] for k, v in b.items()}
    return b["inputs"], b["targets"]
  return nxt


MEMORY_MARGIN = 0.8  # a rank runs only if its bytes stay under this share of the host's available memory


def host_fit(memory: dict, count: bool = True) -> tuple:
  """(fits, bytes needed, bytes available): a rank's compiled peak (arguments, outputs and temporaries of its
  step), plus one more copy of its state when its branches are counted first (``count_branches`` runs a copy),
  against ``MEMORY_MARGIN`` x the memory the host has available now (psutil)."""
  need = memory["peak_bytes"] + (memory["argument_size_in_bytes"] if count else 0)
  avail = psutil.virtual_memory().available
  return need <= MEMORY_MARGIN * avail, need, avail


def run_rank(prog: rp.RankProgram, rank: int, repeats: int = 5, warmup: int = 1, execute: bool = True,
             seed: int = 0, batch: Optional[tuple] = None, state=None, host_data: bool = True,
             count: bool = True, trace_nodes: bool = False, before_step=None) -> RankRun:
  """``trace_nodes``: after timing, run the step twice more under XLA's per-thunk TraceMe (needs
  ``perfmodel.cost.trace_nodes.enable()`` before jax started) and keep each instruction's median in-program time."""
  compiled, interp, compile_s = compile_rank(prog, rank)
  node_times = None
  times, loss = [], float("nan")
  trace, n_conds = None, interp.n_conds
  not_run = ""
  if execute:
    fits, need, avail = host_fit(memory_of(compiled), count)
    if not fits:
      execute = False
      not_run = (f"rank {rank} needs {need / 2**30:.1f} GiB (compiled peak{' + a state copy' if count else ''}) "
                 f"but the host has {avail / 2**30:.1f} GiB available ({MEMORY_MARGIN:.0%} usable): not run, its "
                 f"compute priced from the compiled program with the target profile")
  if execute:
    state = state if state is not None else rp.random_state(prog, seed)
    inputs, targets = batch if batch is not None else rp.random_batch(prog, seed + 1)
    if count:
      trace, n_conds = count_branches(prog, rank, jax.tree.map(lambda x: x.copy(), state), inputs, targets)
    nxt = None
    if host_data and batch is None:
      try:
        nxt = _data_iterator(prog, rank)
        nxt()
      except Exception:  # noqa: BLE001 - e.g. a corpus this host lacks: fixed batch instead (reported)
        nxt = None
    dev = jax.devices()[0]
    cpu = []
    for i in range(warmup + repeats):
      if before_step is not None:  # e.g. start the lockstep shadows' step with this one
        before_step()
      c0, t0 = time.process_time(), time.perf_counter()
      if nxt is not None:
        inputs, targets = (jax.device_put(x, dev) for x in nxt())
      state, l = compiled(state, inputs, targets)
      l = float(l)  # the train loop's host sync (it reads the loss at every logged step)
      if i >= warmup:
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    loss = float(l)
    host_data = nxt is not None
    if trace_nodes:
      box = [state]

      def one():
        box[0], l_ = compiled(box[0], inputs, targets)
        float(l_)
      traced = tn.traced_times(one, reps=2)
      node_times = {k: statistics.median(v) for k, v in traced.items()}
      state = box[0]
    del state
  return RankRun(rank=rank, compile_s=compile_s, step_times_s=times,
                 compute_s=statistics.median(times) if times else float("nan"), memory=memory_of(compiled),
                 hlo_text=compiled.as_text(), records=list(interp.records), loss=loss,
                 device=str(jax.devices()[0].device_kind), branch_trace=trace, n_cond_sites=n_conds,
                 host_data=bool(execute and host_data), step_cpu_s=cpu if execute else [], node_times=node_times,
                 executed=execute, not_run=not_run)
