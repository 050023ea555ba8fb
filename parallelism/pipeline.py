"""Pipeline parallelism over the ``pipeline`` mesh axis: GPipe and 1F1B, shard_map + ppermute.

The layer stack (``layers/...``, leading dim L) is sharded on the logical axis ``layers`` ->
``pipeline``, so stage ``s`` holds layers ``[s*L/P, (s+1)*L/P)`` and the manual-mode model builds
``L/P`` local layers. Embedding, final norm and LM head are replicated over ``pipeline``; only
the first stage embeds and only the last one runs the head and the loss.

**One engine, two schedules.** A schedule is data (:class:`Schedule`): for every tick ``t`` and
stage ``s``, which micro-batch runs its *forward slot* and which its *backward slot* (``-1`` =
idle). Every tick, each stage, in SPMD lock-step:

1. forward slot (``lax.cond``, skipped when idle): ``x = embed(tokens) if first else received``;
   stash ``x`` (the stage *input* only); ``y = blocks(x)``;
2. ``ppermute`` ``y`` to stage ``s+1``;
3. backward slot (``lax.cond``): recompute the stage forward from the stashed input under
   ``jax.vjp`` (plus head + loss on the last stage), pull back the cotangent received from stage
   ``s+1`` (the last stage seeds it with d loss = 1), accumulate parameter gradients;
4. ``ppermute`` the input cotangent to stage ``s-1``.

A forward of micro-batch ``m`` on stage ``s`` always runs the tick after stage ``s-1`` sent it, and a
backward the tick after stage ``s+1`` sent its cotangent (``check_schedule`` proves it for a
table), so nothing waits in a receive buffer; the only per-micro-batch memory is the stash of
stage inputs, ``n_slots`` of them, reused round-robin (slot = m mod n_slots).

* **GPipe**: all forwards (tick ``m+s``), then all backwards (tick ``M+P-1 + m + P-1-s``).
  ``2(M+P-1)`` ticks, stash = ``M`` micro-batch inputs per stage. Bubble ``(P-1)/(M+P-1)``.
* **1F1B**: forward of ``m`` on ``s`` at tick ``m+s``, backward at ``m+2(P-1)-s`` (the last stage
  runs both in the same tick). ``M+2(P-1)`` ticks; stage ``s`` holds at most ``2(P-1-s)+1`` inputs,
  so stash = ``min(M, 2P-1)`` slots, independent of ``M``. Because idle slots are skipped (``cond``),
  the first ``P-1`` ticks cost a forward only and the last ``P-1`` a backward only, so the time is
  ``(M+P-1)(F+B)`` ticks' worth, the same bubble fraction ``(P-1)/(M+P-1)`` as GPipe.

Honest accounting: (a) both schedules recompute the stage forward in the backward
slot (GPipe's paper does the same rematerialisation), so compute is ``2F+B`` per micro-batch and
stage; (b) in-flight memory is stash slots x one micro-batch input (B/M x T x D) plus one
micro-batch's full activations during a backward slot; (c) in lock-step SPMD every tick sends an
activation and a cotangent buffer, zeros when idle; (d) the bubble formulas assume every stage costs
the same (embedding / head make the first / last stage a little heavier);
(e) 1F1B here is Megatron's non-interleaved schedule squeezed into lock-step ticks, so stage 0
stashes up to ``2P-1`` inputs where asynchronous 1F1B needs ``P``.

**Two forms.** ``form='shard_map'``: a shard_map manual over every axis, the manual-mode model,
idle slots skipped with ``lax.cond`` (the costs above). ``form='jit'``: a shard_map manual over
'pipeline' only (``axis_names``) around an auto-mode model of ``L/P`` layers, GSPMD partitioning the
other axes inside. There, XLA 0.10 places GSPMD's own collectives inside ``cond`` branches with
groups that span stages (deadlock), so the jit form replaces every ``cond`` by compute-both-and-
select: every tick costs ``F + B`` on every stage, bubble ``2(P-1)/(M+2(P-1))`` for 1F1B and
``1 - M/(2(M+P-1))`` for GPipe (``Schedule.bubble_fraction(masked=True)``); and XLA's partitioner
aborts when two or more non-pipeline axes have size > 1, so that is refused up front. The jit form
is a correct, compatible path; the shard_map form is the efficient one.

Composes with data / fsdp / tensor / sequence: every collective of those axes happens inside a
``cond`` branch, which is safe because their groups never span two stages (all members of a
data/fsdp/tensor/sequence group share a stage and hence the schedule row). Parameters are made
device-local (``pcast``) over the batch axes *and* ``pipeline`` before the loop so no implicit
all-reduce runs per micro-batch (or, worse, inside a branch that other stages skip); gradients are
summed once after the loop (:func:`parallelism.manual.reduce_grads`). FSDP weights are
still gathered per use (ZeRO-3): their gradient reduce-scatter happens in every backward slot.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from framework.config import Config
from parallelism import manual

SCHEDULES = ("gpipe", "1f1b")
# Named scopes around the schedule's branches: the compiled program's conditionals carry them in their
# op_name, so perfmodel can tell which predicate each one tests (perfmodel/pipeline.py). Each scope's
# predicate is true on: a tick where the stage has forward (FWD) / backward (BWD) work; the first (FIRST)
# / last (LAST) stage.
SCOPE_FWD, SCOPE_BWD, SCOPE_FIRST, SCOPE_LAST = "pp_fwd_slot", "pp_bwd_slot", "pp_first_stage", "pp_last_stage"


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Which micro-batch each stage runs in each tick's forward and backward slot (-1 = idle)."""
  name: str
  n_stages: int
  n_micro: int
  fwd_TxP: np.ndarray
  bwd_TxP: np.ndarray
  n_slots: int  # stage-input stash slots per stage

  @property
  def n_ticks(self) -> int:
    return int(self.fwd_TxP.shape[0])

  def bubble_fraction(self, fwd_cost: float = 1.0, bwd_cost: float = 2.0, masked: bool = False) -> float:
    """Idle share of stage-time in lock-step ticks, when every tick lasts as long as its busiest stage.
    ``masked``: the jit form, where every tick runs both slots on every stage (no skipping)."""
    if masked:
      tick = np.full(self.n_ticks, fwd_cost + bwd_cost)
    else:
      tick = np.max((self.fwd_TxP >= 0) * fwd_cost + (self.bwd_TxP >= 0) * bwd_cost, axis=1)
    return float(1.0 - self.n_micro * (fwd_cost + bwd_cost) / tick.sum())

  def peak_in_flight(self) -> list:
    """Per stage: the most micro-batches whose forward ran but whose backward has not finished."""
    out = []
    for s in range(self.n_stages):
      live, peak = 0, 0
      for t in range(self.n_ticks):
        live += int(self.fwd_TxP[t, s] >= 0)
        peak = max(peak, live)
        live -= int(self.bwd_TxP[t, s] >= 0)
      out.append(peak)
    return out


def make_schedule(name: str, n_stages: int, n_micro: int) -> Schedule:
  if name not in SCHEDULES:
    raise ValueError(f"mesh.schedule={name!r}; choose one of {SCHEDULES}")
  p, m = n_stages, n_micro
  if name == "gpipe":
    n_ticks = 2 * (m + p - 1)
    fwd_tick = lambda mb, s: mb + s  # noqa: E731
    bwd_tick = lambda mb, s: (m + p - 1) + mb + (p - 1 - s)  # noqa: E731
    n_slots = m
  else:
    n_ticks = m + 2 * (p - 1)
    fwd_tick = lambda mb, s: mb + s  # noqa: E731
    bwd_tick = lambda mb, s: mb + 2 * (p - 1) - s  # noqa: E731
    n_slots = min(m, 2 * p - 1)
  fwd = -np.ones((n_ticks, p), np.int32)
  bwd = -np.ones((n_ticks, p), np.int32)
  for s in range(p):
    for mb in range(m):
      fwd[fwd_tick(mb, s), s] = mb
      bwd[bwd_tick(mb, s), s] = mb
  sched = Schedule(name, p, m, fwd, bwd, n_slots)
  check_schedule(sched)
  return sched


def check_schedule(s: Schedule) -> None:
  """Proves the properties the engine relies on; raises AssertionError naming the violation."""
  p, m = s.n_stages, s.n_micro
  where_f, where_b = {}, {}
  for t in range(s.n_ticks):
    for st in range(p):
      if s.fwd_TxP[t, st] >= 0:
        where_f[(int(s.fwd_TxP[t, st]), st)] = t
      if s.bwd_TxP[t, st] >= 0:
        where_b[(int(s.bwd_TxP[t, st]), st)] = t
  assert len(where_f) == len(where_b) == p * m, "every (micro-batch, stage) needs one forward and one backward"
  for (mb, st), t in where_f.items():
    if st > 0:
      assert where_f[(mb, st - 1)] == t - 1, f"forward {mb} on stage {st} must follow stage {st - 1} by one tick"
    assert where_b[(mb, st)] >= t, f"backward {mb} on stage {st} before its forward"
  for (mb, st), t in where_b.items():
    if st < p - 1:
      assert where_b[(mb, st + 1)] == t - 1, f"backward {mb} on stage {st} must follow stage {st + 1} by one tick"
  for st in range(p):  # stash: a slot is never overwritten while its micro-batch awaits its backward
    holder = {}
    for t in range(s.n_ticks):
      f, b = int(s.fwd_TxP[t, st]), int(s.bwd_TxP[t, st])
      if f >= 0:
        assert holder.get(f % s.n_slots) is None, f"stash slot {f % s.n_slots} of stage {st} overwritten at tick {t}"
        holder[f % s.n_slots] = f
      if b >= 0:
        assert holder.get(b % s.n_slots) == b, f"stash slot for micro-batch {b} of stage {st} lost at tick {t}"
        holder[b % s.n_slots] = None


def _cond(pred, true_fn, false_fn, *args):
  return jax.lax.cond(pred, true_fn, false_fn, *args)


def _select(pred, true_fn, false_fn, *args):
  """Both branches run on every device, the result is selected: no divergent control flow."""
  t, f = true_fn(*args), false_fn(*args)
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), t, f)


def loss_and_grads_body(cfg: Config, model, specs, n_tokens: int, batch_axes: tuple, masked: bool = False,
                        reduce=manual.reduce_grads):
  """Per-device (params, inputs, targets) -> (loss, grads) running the pipeline; goes inside shard_map.

  ``model`` is either the manual-mode model (all axes manual: explicit DP/FSDP/TP/SP collectives,
  ``batch_axes`` = the batch axes of size > 1) or, for ``form='jit'``, an auto-mode model of
  ``n_layers / pipeline`` layers inside a shard_map that is manual over 'pipeline' only
  (``batch_axes=()``: GSPMD partitions everything else).

  ``masked=True`` replaces every ``lax.cond`` by compute-both-and-select. The jit form needs it: GSPMD
  inserts its own collectives inside the branches, and in XLA 0.10 those can span the manual
  'pipeline' axis, so devices taking different branches deadlock (observed on CPU). Masking costs
  compute: every tick runs a forward and a backward on every stage, idle or not.

  ``reduce``: how the summed gradients are reduced over devices after the loop, ``(grads, specs, axes)``
  (ZeRO-1 passes a reduce-scatter, parallelism/zero.py)."""
  sched = make_schedule(cfg.mesh.schedule, cfg.mesh.pipeline, cfg.mesh.microbatches)
  reduce_over = tuple(batch_axes) + (manual.PIPELINE_AXIS,)
  return functools.partial(_body, model=model, specs=specs, sched=sched, n_tokens=n_tokens,
                           batch_axes=tuple(batch_axes), reduce_over=reduce_over,
                           branch=_select if masked else _cond, reduce=reduce)


def _body(params, inputs_BxT, targets_BxT, *, model, specs, sched: Schedule, n_tokens: int,
          batch_axes: tuple, reduce_over: tuple, branch, reduce=manual.reduce_grads):
  p, m, k = sched.n_stages, sched.n_micro, sched.n_slots
  stage = jax.lax.axis_index(manual.PIPELINE_AXIS)
  is_first, is_last = stage == 0, stage == p - 1
  b_local, t_local = inputs_BxT.shape
  mb = b_local // m
  tok_MxBxT = inputs_BxT.reshape(m, mb, t_local)
  tgt_MxBxT = targets_BxT.reshape(m, mb, t_local)
  pos_BxT = manual.positions((mb, t_local), model.ctx.size((manual.SEQUENCE_AXIS,)))
  local = manual.localize_params(params, specs, reduce_over)
  # Typed templates: the activation flowing between stages varies over the batch axes and
  # 'pipeline' (it is stage-dependent) and is invariant over 'tensor' (after the TP psum).
  x_proto = manual.vary(jnp.zeros((mb, t_local, model.cfg.d_model), jnp.dtype(model.cfg.dtype)),
                        batch_axes + (manual.PIPELINE_AXIS,))
  loss_proto = manual.vary(jnp.zeros((), jnp.float32), batch_axes + (manual.PIPELINE_AXIS,))

  def stage_forward(prm, x_recv_BxTxD, tok_BxT):
    embed = lambda: model.apply({"params": prm}, tok_BxT, method="embed")  # noqa: E731
    with jax.named_scope(SCOPE_FIRST):
      x = branch(is_first, embed, lambda: x_recv_BxTxD)
    y, _ = model.apply({"params": prm}, x, pos_BxT, method="blocks")
    return y

  def stage_loss(prm, y_BxTxD, tgt_BxT):
    def head():
      logits = model.apply({"params": prm}, y_BxTxD, method="head")
      loss = manual.token_loss_sum(model, logits, tgt_BxT) / n_tokens
      return manual.vary(loss, tuple(manual.varying_axes(loss_proto)))
    with jax.named_scope(SCOPE_LAST):
      return branch(is_last, head, lambda: loss_proto)

  def tick(carry, row):
    recv_x, recv_dx, stash, gacc, loss_acc = carry
    fm, bm = row[0][stage], row[1][stage]

    # Forward slot. The last stage only stashes: its backward slot recomputes everything anyway.
    def fwd(stash):
      stash = jax.lax.dynamic_update_index_in_dim(stash, recv_x, fm % k, 0)
      with jax.named_scope(SCOPE_LAST):
        y = branch(is_last, lambda: x_proto, lambda: stage_forward(local, recv_x, tok_MxBxT[fm]))
      return y, stash
    with jax.named_scope(SCOPE_FWD):
      y, stash = branch(fm >= 0, fwd, lambda st: (x_proto, st), stash)
    recv_x = jax.lax.ppermute(y, manual.PIPELINE_AXIS, [(i, i + 1) for i in range(p - 1)])

    # Backward slot: recompute the stage forward from its stashed input, pull back the cotangent.
    def bwd(gacc, loss_acc):
      x_in = jax.lax.dynamic_index_in_dim(stash, bm % k, 0, keepdims=False)
      tok, tgt = tok_MxBxT[bm], tgt_MxBxT[bm]

      def f(prm, x):
        y = stage_forward(prm, x, tok)
        return y, stage_loss(prm, y, tgt)
      (_, loss), pullback = jax.vjp(f, local, x_in)
      dy = jnp.where(is_last, jnp.zeros_like(recv_dx), recv_dx)
      d_prm, d_x = pullback((dy, jnp.ones_like(loss_proto)))
      gacc = jax.tree.map(jnp.add, gacc, d_prm)
      return manual.vary(d_x, tuple(manual.varying_axes(x_proto))), gacc, loss_acc + loss
    with jax.named_scope(SCOPE_BWD):
      d_x, gacc, loss_acc = branch(bm >= 0, bwd, lambda g, l: (x_proto, g, l), gacc, loss_acc)
    recv_dx = jax.lax.ppermute(d_x, manual.PIPELINE_AXIS, [(i + 1, i) for i in range(p - 1)])
    return (recv_x, recv_dx, stash, gacc, loss_acc), None

  stash = manual.vary(jnp.zeros((k,) + x_proto.shape, x_proto.dtype), tuple(manual.varying_axes(x_proto)))
  gacc = jax.tree.map(manual.zeros_like_typed, local)
  carry = (x_proto, x_proto, stash, gacc, loss_proto)
  rows = (jnp.asarray(sched.fwd_TxP), jnp.asarray(sched.bwd_TxP))
  (_, _, _, gacc, loss_acc), _ = jax.lax.scan(tick, carry, rows)
  grads = reduce(gacc, specs, reduce_over)
  return jax.lax.psum(loss_acc, reduce_over), grads
