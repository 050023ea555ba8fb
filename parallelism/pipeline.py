"""Pipeline parallelism over the ``pipeline`` mesh axis: one lock-step engine for every schedule table.

The layer stack (``layers/...``) is sharded on the logical axis ``layers`` -> ``pipeline``. With
``mesh.virtual_stages = v > 1`` the model stores it as ``v x L/v`` (``ParallelCtx.layer_repeats``), so stage ``s``
holds chunks ``j = 0..v-1`` of ``L/(vP)`` layers each, chunk ``j`` being virtual stage ``jP + s`` (round-robin).
Embedding, final norm and LM head are replicated over ``pipeline``; the first virtual stage embeds, the last one
runs the head and the loss. Which unit (micro-batch, chunk) runs in which tick is data: a
:class:`~parallelism.schedules.Schedule` (GPipe, 1F1B, and with ``v > 1`` MaxText's circular pipeline and
Megatron's interleaved 1F1B; parallelism/schedules.py). Every tick, each stage, in SPMD lock-step:

1. forward slot (``lax.cond``, skipped when idle): ``x = embed(tokens)`` on the first virtual stage, else the
   activation received last tick; ``y = chunk(x)``, a scan over the chunk's layers, each under ``jax.vjp`` and
   reading its weights in place from the stage's stack (no per-tick copy of the chunk's weights); the vjp's
   residuals that depend on ``x`` go to the unit's stash slot (parallelism/stash.py); on the last stage ``y`` is
   kept for the head;
2. ``ppermute`` ``y`` to stage ``s+1`` (around the ring, ``P-1 -> 0``, when ``v > 1``);
3. backward slot (``lax.cond``): on the last virtual stage, head + loss and their vjp (seeded with d loss = 1)
   give the cotangent, elsewhere it is the one received; each layer's pullback, in reverse, is rebuilt from the
   stash (parameter-only residuals recomputed) and applied; the first virtual stage pulls back through the embedding;
   parameter gradients accumulate (per chunk);
4. ``ppermute`` the input cotangent to stage ``s-1``.

**Compute.** A unit's forward runs once and its backward once: ``F + B`` per micro-batch and stage. Recomputation
happens only inside the layers, as ``model.remat`` says (``full``: the backward re-runs each layer's forward from
its input: ``2F + B``). The head's forward runs in the
backward slot of the last virtual stage, once per micro-batch.

**Memory.** Stash = ``n_slots x R`` per stage, ``R`` = the residuals of one micro-batch through one chunk (for
``remat=none`` every saved activation of ``L/(vP)`` layers; for ``full`` their inputs, ``L/(vP) x B/M x T x D``),
plus ``n_head_slots x B/M x T x D`` for the head's input. ``n_slots``: ``vM`` (gpipe), ``min(vM, (v+1)P - 1)`` (1f1b,
``min(M, 2P-1)`` for ``v = 1``); ``n_head_slots``: ``n_slots`` (gpipe), 1 (1f1b). Lock-step ticks make 1F1B stash
up to ``2P-1`` units on stage 0 where Megatron's asynchronous 1F1B holds ``P`` (its interleaved schedule holds the
same ``(v+1)P - 1`` as here). Residuals in SPMD are the same shape on every stage, so every stage allocates
stage 0's count.

Honest accounting: (a) in lock-step SPMD every tick sends an activation and a cotangent buffer, zeros when idle;
(b) the bubble formulas assume every stage costs the same (embedding / head make the first / last stage a little
heavier); (c) :func:`~parallelism.schedules.bubble_formula` gives ``(P-1)/(vM + P - 1)`` for both schedules.

**Two forms.** ``form='shard_map'``: a shard_map manual over every axis, the manual-mode model, idle slots skipped
with ``lax.cond`` (the costs above). ``form='jit'``: a shard_map manual over 'pipeline' only (``axis_names``)
around an auto-mode model of ``L/P`` layers, GSPMD partitioning the other axes inside. There, XLA 0.10 places
GSPMD's own collectives inside ``cond`` branches with groups that span stages (deadlock), so the jit form replaces
every ``cond`` by compute-both-and-select: every tick costs a forward and a backward slot on every stage, bubble
``1 - vM / n_ticks`` (``Schedule.bubble_fraction(masked=True)``), and the selected stash is copied every tick;
XLA's partitioner aborts when two or more non-pipeline axes have size > 1, so that is refused up front. The jit
form is a correct, compatible path; the shard_map form is the efficient one.

Composes with data / fsdp / tensor / sequence: every collective of those axes happens inside a ``cond`` branch,
which is safe because their groups never span two stages. Parameters are made device-local (``pcast``) over the
batch axes *and* ``pipeline`` before the loop so no implicit all-reduce runs per micro-batch; gradients are summed
once after the loop (:func:`parallelism.manual.reduce_grads`). FSDP weights are gathered in the forward slot and
again in the backward slot (ZeRO-3); their gradient reduce-scatter happens in every backward slot.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from framework.config import Config
from framework import fp8
from framework import model as model_lib
from framework import moe as moe_lib
from parallelism import manual, stash
from parallelism.schedules import SCHEDULES, Schedule, bubble_formula, check_schedule, make_schedule  # noqa: F401

# Named scopes around the schedule's branches: the compiled program's conditionals carry them in their op_name, so
# perfmodel can tell which predicate each one tests (perfmodel/pipeline.py). Each scope's predicate is true on: a
# tick where the stage has forward (FWD) / backward (BWD) work; a unit of the first (FIRST) / last (LAST) virtual
# stage.
SCOPE_FWD, SCOPE_BWD, SCOPE_FIRST, SCOPE_LAST = "pp_fwd_slot", "pp_bwd_slot", "pp_first_stage", "pp_last_stage"


def schedule_of(cfg: Config) -> Schedule:
  """The schedule table a pipelined config's step runs."""
  m = cfg.mesh
  return make_schedule(m.schedule, m.pipeline, m.microbatches, m.virtual_stages)


def layer_repeats(cfg: Config) -> int:
  """How the config's layer stack is stored (``ParallelCtx.layer_repeats``): ``v`` chunks when pipelined."""
  return cfg.mesh.virtual_stages if cfg.mesh.pipeline > 1 else 1


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
  (``batch_axes=()``: GSPMD partitions everything else). Either stores its stack as ``layer_repeats(cfg)`` chunks.

  ``masked=True`` replaces every ``lax.cond`` by compute-both-and-select. The jit form needs it: GSPMD
  inserts its own collectives inside the branches, and in XLA 0.10 those can span the manual
  'pipeline' axis, so devices taking different branches deadlock (observed on CPU). Masking costs
  compute: every tick runs a forward and a backward on every stage, idle or not.

  ``reduce``: how the summed gradients are reduced over devices after the loop, ``(grads, specs, axes)``
  (ZeRO-1 passes a reduce-scatter, parallelism/zero.py)."""
  reduce_over = tuple(batch_axes) + (manual.PIPELINE_AXIS,)
  return functools.partial(_body, model=model, specs=specs, sched=schedule_of(cfg), n_tokens=n_tokens,
                           batch_axes=tuple(batch_axes), reduce_over=reduce_over,
                           branch=_select if masked else _cond, reduce=reduce)


def _body(params, inputs_BxT, targets_BxT, *, model, specs, sched: Schedule, n_tokens: int,
          batch_axes: tuple, reduce_over: tuple, branch, reduce=manual.reduce_grads):
  p, m, v = sched.n_stages, sched.n_micro, sched.n_chunks
  stage = jax.lax.axis_index(manual.PIPELINE_AXIS)
  is_first, is_last = stage == 0, stage == p - 1
  inputs_BxT, targets_BxT, pos_BxT = manual.sequence_layout(model, inputs_BxT, targets_BxT)
  b_local, t_local = inputs_BxT.shape
  mb = b_local // m
  tok_MxBxT = inputs_BxT.reshape(m, mb, t_local)
  tgt_MxBxT = targets_BxT.reshape(m, mb, t_local)
  pos_BxT = pos_BxT[:mb]
  local = manual.localize_params(params, specs, reduce_over)
  layers = local["layers"]
  rest = {k: x for k, x in local.items() if k != "layers"}
  # fp8: the stage's projection weights quantized once, before the ticks (framework/model.py fp8_cache)
  layers_fp8 = model_lib.fp8_cache(model.cfg, layers).get(fp8.CACHE, {})
  # The chunk's layers run one at a time, each read in place from the stage's stack (``layer_of``): slicing a
  # whole chunk out of the stack for the layer scan would copy the chunk's weights in every slot of every tick.
  # ``layer_model`` is the model cut to one layer (stored with a leading axis of 1, as its scan stores it).
  lc = model.n_local_layers
  layer_model = model.clone(cfg=dataclasses.replace(model.cfg, n_layers=model.cfg.n_layers // (v * lc)),
                            ctx=dataclasses.replace(model.ctx, layer_repeats=1))

  def layer_of(j, i, stack=None):
    """Layer ``i`` of chunk ``j`` of the stage's stack (or of ``stack``), as a one-layer stack (``[1, ...]``)."""
    def one(a):
      if v == 1:
        return jax.lax.dynamic_slice_in_dim(a, i, 1, 0)
      zero = jnp.zeros((), jnp.int32)
      out = jax.lax.dynamic_slice(a, (j, i) + (zero,) * (a.ndim - 2), (1, 1) + a.shape[2:])
      return out.reshape(out.shape[1:])
    return jax.tree.map(one, layers if stack is None else stack)

  def layer_in(j, i):
    """What a layer's vjp differentiates and reads: (its parameters, its fp8 weights)."""
    return layer_of(j, i), layer_of(j, i, layers_fp8)
  # Typed templates: the activation flowing between stages varies over the batch axes and
  # 'pipeline' (it is stage-dependent) and is invariant over 'tensor' (after the TP psum), or under sequence
  # parallelism is this tensor rank's T/tensor chunk (after the TP psum_scatter), varying over 'tensor'.
  t_res, x_vary = t_local, batch_axes + (manual.PIPELINE_AXIS,)
  if model.ctx.tp_sequence_sharded:
    t_res, x_vary = t_local // model.ctx.size((manual.TENSOR_AXIS,)), x_vary + (manual.TENSOR_AXIS,)
  x_proto = manual.vary(jnp.zeros((mb, t_res, model.cfg.d_model), jnp.dtype(model.cfg.dtype)), x_vary)
  x_axes = tuple(manual.varying_axes(x_proto))
  loss_proto = manual.vary(jnp.zeros((), jnp.float32), batch_axes + (manual.PIPELINE_AXIS,))
  loss_axes = tuple(manual.varying_axes(loss_proto))

  moe = model.cfg.moe
  seq_shards = model.ctx.size((manual.SEQUENCE_AXIS,)) if model.ctx.manual else 1
  n_seqs = n_tokens // (t_local * seq_shards)  # the whole batch's sequences (the balance term's mean)
  n_layers = model.n_local_layers * p * v  # the whole model's (the jit form's stage model holds L / P)

  def blocks(layer, x_BxTxD):
    """One layer's output; with experts (output, its balance term, its assignments per expert, ``1 x E``)."""
    layer_prm, layer_fp8 = layer
    variables = {"params": {"layers": layer_prm}, **({fp8.CACHE: {"layers": layer_fp8}} if layer_fp8 else {})}
    if not moe:
      y, _ = layer_model.apply(variables, x_BxTxD, pos_BxT, method="blocks")
      return manual.vary(y, x_axes)
    (y, _), moe_vars = layer_model.apply(variables, x_BxTxD, pos_BxT, method="blocks", mutable=["moe"])
    c = model.cfg
    aux = moe_lib.aux_loss(moe_vars["moe"], c.aux_loss_coef, n_layers, n_seqs * seq_shards)
    load = moe_lib.layer_load(moe_vars["moe"], c.n_experts)
    return manual.vary(y, x_axes), manual.vary(aux, loss_axes), manual.vary(load, loss_axes)

  def embed(prm, tok_BxT):
    return manual.vary(model.apply({"params": prm}, tok_BxT, method="embed"), x_axes)

  def head_loss(prm, y_BxTxD, tgt_BxT):
    logits = model.apply({"params": prm}, y_BxTxD, method="head")
    loss = manual.token_loss_sum(model, logits, tgt_BxT) / n_tokens
    return manual.vary(loss, loss_axes)

  split = stash.SplitVjp(blocks, layer_in(0, 0), x_proto)
  if moe:  # the chunk's extra outputs: a balance term (seeded with d loss = 1 in the backward) and expert counts
    aux_proto = loss_proto
    load_proto = manual.vary(jnp.zeros((lc, model.cfg.n_experts), jnp.float32), loss_axes)
    y_proto = (x_proto, aux_proto, load_proto)
    seed = (jnp.ones_like(aux_proto), manual.vary(jnp.zeros((1, model.cfg.n_experts), jnp.float32), loss_axes))
  else:
    y_proto, seed = x_proto, ()

  def chunk_forward(j, x):
    """Chunk ``j`` on ``x``: its output (with experts: output, balance term, ``L/(vP) x E`` assignments) and its
    stash (each layer's stashed residuals, stacked on a leading axis of ``L/(vP)``)."""
    def layer(carry, i):
      x, aux = carry
      out, res = split.forward(layer_in(j, i), x)
      if not moe:
        return (out, aux), (res, ())
      y, a, load = out
      return (y, aux + a), (res, load[0])
    (y, aux), (res, load) = jax.lax.scan(layer, (x, loss_proto), jnp.arange(lc))
    return ((y, aux, load) if moe else y), res

  def chunk_backward(j, res, dy):
    """(d the chunk's layers ``[L/(vP), ...]``, d its input) from its stash, the layers in reverse."""
    def layer(dx, i_res):
      i, r = i_res
      (d_prm, _), dx = split.backward(layer_in(j, i), r, (dx,) + seed if moe else dx)  # fp8 weights: no gradient
      return manual.vary(dx, x_axes), jax.tree.map(lambda a: a.reshape(a.shape[1:]), d_prm)
    dx, d_chunk = jax.lax.scan(layer, dy, (jnp.arange(lc), res), reverse=True)
    return d_chunk, dx

  head_slot = (lambda k: k) if sched.n_head_slots > 1 else (lambda k: 0)  # noqa: E731

  def add_chunk(g_layers, d_chunk, j):
    """``g_layers[j] += d_chunk`` (the whole stack when there is one chunk): outside the backward slot's
    conditional, so only one chunk's gradients are read and written per tick (an idle tick adds zeros)."""
    if v == 1:
      return jax.tree.map(jnp.add, g_layers, d_chunk)
    k = jnp.maximum(j, 0)
    return jax.tree.map(lambda g, d: jax.lax.dynamic_update_index_in_dim(
        g, jax.lax.dynamic_index_in_dim(g, k, 0, keepdims=False) + d, k, 0), g_layers, d_chunk)

  ring = v > 1
  fwd_perm = [(i, (i + 1) % p) for i in range(p if ring else p - 1)]
  bwd_perm = [((i + 1) % p, i) for i in range(p if ring else p - 1)]

  def write(buf, val, slot, on):
    """``buf[slot] = val`` where ``on``, else the slot unchanged: one slot is read and written, never the buffer."""
    k = jnp.where(on, slot, 0)
    old = jax.lax.dynamic_index_in_dim(buf, k, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(on, val, old), k, 0)

  def read(buf, slot):
    return jax.lax.dynamic_index_in_dim(buf, jnp.maximum(slot, 0), 0, keepdims=False)

  res_protos = [b[0] for b in split.zeros(1, lc)]

  # The stash buffers and the layers' gradient accumulator never enter a branch: a branch returns one unit's
  # values and the slot is written (or read, or added to) outside it. A buffer passed through a conditional is
  # copied whole by XLA on every tick (the idle branch's pass-through aliases it), which is n_slots times the
  # stash's traffic and twice its memory, and for the accumulator v times the stage's gradients per tick.
  def tick(carry, row):
    recv_x, recv_dx, res_bufs, y_buf, g_layers, g_rest, loss_acc, load_acc = carry
    fm, fj, fk, bm, bj, bk = (r[stage] for r in row)

    # Forward slot: run the chunk; what its backward will read goes to the unit's stash slot.
    def fwd():
      with jax.named_scope(SCOPE_FIRST):
        x = branch(is_first & (fj == 0), lambda: embed(rest, tok_MxBxT[fm]), lambda: recv_x)
      return chunk_forward(fj, x)
    with jax.named_scope(SCOPE_FWD):
      y, res = branch(fm >= 0, fwd, lambda: (y_proto, res_protos))
    if moe:  # an idle slot's outputs are the protos' zeros
      y, aux, load = y
      loss_acc = loss_acc + aux
      load_acc = write(load_acc, read(load_acc, fj) + load, fj, fm >= 0)
    res_bufs = [write(buf, r, fk, fm >= 0) for buf, r in zip(res_bufs, res)]
    y_buf = write(y_buf, y, head_slot(fk), fm >= 0)
    recv_x = jax.lax.ppermute(y, manual.PIPELINE_AXIS, fwd_perm)

    # Backward slot: the head (last virtual stage), the chunk's stashed pullback, the embedding (first).
    res = [read(buf, bk) for buf in res_bufs]
    y_in = read(y_buf, head_slot(bk))

    def bwd(g_rest, loss_acc):
      def head(g_rest, loss_acc):
        loss, pullback = jax.vjp(lambda prm, yy: head_loss(prm, yy, tgt_MxBxT[bm]), rest, y_in)
        d_rest, dy = pullback(jnp.ones_like(loss))
        return manual.vary(dy, x_axes), jax.tree.map(jnp.add, g_rest, d_rest), loss_acc + loss
      with jax.named_scope(SCOPE_LAST):
        dy, g_rest, loss_acc = branch(is_last & (bj == v - 1), head, lambda g, l: (recv_dx, g, l), g_rest, loss_acc)
      d_chunk, dx = chunk_backward(bj, res, dy)

      def embed_bwd(g_rest):
        _, pullback = jax.vjp(lambda prm: embed(prm, tok_MxBxT[bm]), rest)
        return jax.tree.map(jnp.add, g_rest, pullback(dx)[0])
      with jax.named_scope(SCOPE_FIRST):
        g_rest = branch(is_first & (bj == 0), embed_bwd, lambda g: g, g_rest)
      return manual.vary(dx, x_axes), d_chunk, g_rest, loss_acc
    with jax.named_scope(SCOPE_BWD):
      dx, d_chunk, g_rest, loss_acc = branch(bm >= 0, bwd, lambda gr, l: (x_proto, d_zero, gr, l), g_rest, loss_acc)
    g_layers = add_chunk(g_layers, d_chunk, bj)
    recv_dx = jax.lax.ppermute(dx, manual.PIPELINE_AXIS, bwd_perm)
    return (recv_x, recv_dx, res_bufs, y_buf, g_layers, g_rest, loss_acc, load_acc), None

  res_bufs = split.zeros(sched.n_slots, lc)
  y_buf = manual.vary(jnp.zeros((sched.n_head_slots,) + x_proto.shape, x_proto.dtype), x_axes)
  g_layers = jax.tree.map(manual.zeros_like_typed, layers)
  d_zero = jax.tree.map(lambda a: manual.zeros_like_typed(a if v == 1 else a[0]), layers)
  g_rest = jax.tree.map(manual.zeros_like_typed, rest)
  load_acc = manual.vary(jnp.zeros((v,) + load_proto.shape, jnp.float32), loss_axes) if moe else None
  carry = (x_proto, x_proto, res_bufs, y_buf, g_layers, g_rest, loss_proto, load_acc)
  rows = tuple(jnp.asarray(t) for t in (sched.fwd_TxP, sched.fwd_chunk_TxP, sched.fwd_slot_TxP,
                                        sched.bwd_TxP, sched.bwd_chunk_TxP, sched.bwd_slot_TxP))
  (_, _, _, _, g_layers, g_rest, loss_acc, load_acc), _ = jax.lax.scan(tick, carry, rows)
  grads = {k: (g_layers if k == "layers" else g_rest[k]) for k in local}
  grads = reduce(grads, specs, reduce_over)
  loss = jax.lax.psum(loss_acc, reduce_over)
  if not moe:
    return loss, grads
  # stage s, chunk j holds virtual stage jP + s: gathered over the stages, the layers come out in order
  load_acc = jax.lax.psum(load_acc, batch_axes) if batch_axes else load_acc
  load_PxVxLxE = jax.lax.all_gather(load_acc, manual.PIPELINE_AXIS, axis=0, tiled=False, to="invarying")
  return loss, grads, load_PxVxLxE.transpose(1, 0, 2, 3).reshape(-1, model.cfg.n_experts)

