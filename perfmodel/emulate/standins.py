"""Stand-in collectives: run one rank's per-device program alone, with every collective replaced.

A per-device program (the body of a ``shard_map`` step, traced at the *target* mesh's axis sizes on an
``AbstractMesh``, so per-rank shapes are real) names its collectives explicitly: ``psum``,
``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``, ``pmax``/``pmin`` and ``axis_index``.
:class:`Interpreter` evaluates that jaxpr on *one* local device, replacing each collective by a local
stand-in with the identical output shape and dtype, and records what the real collective would have
moved (kind, mesh axes, group of global rank ids, payload bytes, how many times it runs).

Stand-in semantics: the virtual peers are assumed to hold the *same* data as the real rank, so
``psum`` is ``x * n``, ``all_gather`` tiles ``x`` n times, ``psum_scatter`` takes this rank's slice
times n, ``all_to_all`` re-chunks locally, ``ppermute``/``pmax``/``pmin`` are the identity and
``axis_index`` is this rank's coordinate (so pipeline-stage branches take this rank's branch). With
identical peers those are the *exact* results of the real collectives; otherwise every value that
depends only on local data (loss, local gradients before the reduction) is still exact.

Why ``optimization_barrier`` around each stand-in: a real collective is an XLA fusion boundary and
materialises its output buffer. Without the barrier XLA would fold ``x * n`` into a neighbouring
fusion or never materialise a tiled all-gather, and the measured local compute (and the compiled
program's memory) would stop being the real rank's. Each stand-in also runs under
``jax.named_scope('emu_c<index>')`` so the compiled HLO can be mapped back to the record.

Higher-order primitives are re-expressed through their public APIs (``lax.scan``, ``lax.while_loop``,
``lax.switch``, ``jax.checkpoint`` with the same policy) around an interpreted body, so the compiled
structure (a while loop over layers, remat barriers) stays the real one.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from perfmodel.emulate.topology import RankSpace

# primitive name -> perfmodel collective kind (perfmodel.cost.collectives / hlo_parse names)
COLLECTIVE_KIND = {
    "psum": "all-reduce", "psum_invariant": "all-reduce", "psum2": "all-reduce", "pmax": "all-reduce",
    "pmin": "all-reduce", "all_gather": "all-gather", "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter", "psum_scatter": "reduce-scatter", "all_to_all": "all-to-all",
    "ppermute": "collective-permute",
}
IDENTITY_PRIMS = ("pvary", "pcast", "pbroadcast")
MARKER = "emu_c"
BRANCH_MARKER = "emu_b"


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
  index: int  # order of first appearance in the program
  kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
  primitive: str
  axes: tuple  # mesh axes it runs over
  group_size: int
  bytes: float  # payload S in the alpha-beta formulas (perfmodel.cost.collectives convention)
  shape: tuple  # operand shape (per rank)
  dtype: str
  trips: int  # executions per step (product of enclosing scan lengths)
  scope: str  # enclosing control flow, e.g. 'scan[5]/checkpoint'
  perm: tuple = ()  # ppermute (src, dst) positions along the axes
  operand_bytes: tuple = ()  # per-operand payloads when one equation moves several buffers (sum = bytes)

  def sizes(self) -> list:
    """Payload of each buffer the call moves (a multi-operand psum is a tuple collective)."""
    return list(self.operand_bytes) if len(self.operand_bytes) > 1 else [self.bytes]

  def group(self, space: RankSpace, rank: int) -> tuple:
    """Global rank ids taking part with ``rank`` (for a permute: this rank and its destination)."""
    g = space.group(rank, self.axes)
    if self.kind == "collective-permute":
      pos = space.position(rank, self.axes)
      dst = dict(self.perm).get(pos)
      if dst is not None:
        return (rank, g[dst])
      # A receiver takes part too: the transfer into it is on its timeline (synchronous on gloo).
      src = {d: s for s, d in self.perm}.get(pos)
      return (rank,) if src is None else (g[src], rank)
    return g


def _axes(name) -> tuple:
  if name is None:
    return ()
  return tuple(name) if isinstance(name, (tuple, list)) else (name,)


def _read(env, v):
  return v.val if isinstance(v, jcore.Literal) else env[v]


def _nbytes(aval) -> float:
  return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)


def _sub_jaxprs(params) -> list:
  out = []
  for p in params.values():
    for q in (p if isinstance(p, (tuple, list)) else (p,)):
      if isinstance(q, jcore.ClosedJaxpr):
        out.append(q.jaxpr)
      elif isinstance(q, jcore.Jaxpr):
        out.append(q)
  return out


def has_collectives(jaxpr) -> bool:
  for e in jaxpr.eqns:
    if e.primitive.name in COLLECTIVE_KIND or e.primitive.name == "axis_index":
      return True
    if any(has_collectives(j) for j in _sub_jaxprs(e.params)):
      return True
  return False


def _opaque(value, dtype):
  return jax.lax.optimization_barrier(jnp.asarray(value, dtype))


class Interpreter:
  """Evaluates a per-device jaxpr for one rank with stand-in collectives (see module docstring).

  Use under a trace (``jax.jit``/``make_jaxpr``): ``records`` fill in during tracing, one per
  collective *site*, each with its per-step multiplicity."""

  def __init__(self, space: RankSpace, rank: int):
    self.space, self.rank = space, rank
    self.records: list = []
    self._sites: dict = {}
    self._scope: list = []  # [(label, trips)]
    self._path: list = []  # ids of the enclosing higher-order equations (a call site's identity)
    self.n_conds = 0  # runtime-decided cond sites, marked BRANCH_MARKER<i> in the compiled HLO
    self._cond_sites: dict = {}
    self.count_branches = False  # counting build: every branch reports (site, branch) when it runs
    self.branch_trace: dict = {}  # cond site -> [branch index per execution, in execution order]

  # -------------------------------------------------------------- public
  def __call__(self, closed: jcore.ClosedJaxpr, *args):
    return self.eval(closed.jaxpr, closed.consts, *args)

  def eval(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], *args) -> list:
    env = {}
    for v, x in zip(jaxpr.constvars, consts):
      env[v] = x
    if len(args) != len(jaxpr.invars):
      raise ValueError(f"per-device program takes {len(jaxpr.invars)} inputs, got {len(args)}")
    for v, x in zip(jaxpr.invars, args):
      env[v] = x
    for eqn in jaxpr.eqns:
      invals = [_read(env, v) for v in eqn.invars]
      outs = self._eqn(eqn, invals)
      for v, x in zip(eqn.outvars, outs):
        env[v] = x
    return [_read(env, v) for v in jaxpr.outvars]

  # -------------------------------------------------------------- dispatch
  def _eqn(self, eqn, invals) -> list:
    name = eqn.primitive.name
    if name in IDENTITY_PRIMS:
      return list(invals)
    if name == "axis_index":
      return [jnp.asarray(self.space.position(self.rank, _axes(eqn.params["axis_name"])), jnp.int32)]
    if name in COLLECTIVE_KIND:
      return self._collective(eqn, invals)
    handler = getattr(self, "_hop_" + name.replace("-", "_"), None)
    if handler is not None:
      self._path.append(id(eqn))
      try:
        return handler(eqn, invals)
      finally:
        self._path.pop()
    if _sub_jaxprs(eqn.params) and any(has_collectives(j) for j in _sub_jaxprs(eqn.params)):
      raise NotImplementedError(
          f"primitive {name!r} holds collectives in a sub-program the emulator cannot re-express yet: add a "
          f"_hop_{name} handler to perfmodel/emulate/standins.py")
    out = eqn.primitive.bind(*invals, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]

  # -------------------------------------------------------------- collectives
  def _site(self, eqn, kind: str, axes: tuple, operand_avals, out_avals) -> int:
    # The same equation reached through two call sites (a jaxpr shared by two calls) runs twice: the
    # key is the call path. Re-tracing one site (jax.checkpoint may trace its body again) is deduplicated.
    key = (tuple(self._path), id(eqn))
    if key in self._sites:
      return self._sites[key]
    n = math.prod(self.space.axis_sizes.get(a, 1) for a in axes)
    a_in = operand_avals[0]
    per = tuple(float(_nbytes(a)) for a in (out_avals if kind == "all-gather" else operand_avals))
    payload = sum(per)
    trips = math.prod(t for _, t in self._scope)
    perm = tuple(tuple(p) for p in eqn.params.get("perm", ()))
    rec = CollectiveRecord(index=len(self.records), kind=kind, primitive=eqn.primitive.name, axes=axes,
                           group_size=n, bytes=payload, shape=tuple(a_in.shape), dtype=str(a_in.dtype),
                           trips=trips, scope="/".join(l for l, _ in self._scope), perm=perm,
                           operand_bytes=per)
    self.records.append(rec)
    self._sites[key] = rec.index
    return rec.index

  def _collective(self, eqn, invals) -> list:
    name, p = eqn.primitive.name, eqn.params
    kind = COLLECTIVE_KIND[name]
    axes = _axes(p.get("axes", p.get("axis_name")))
    if p.get("axis_index_groups") is not None:
      raise NotImplementedError("collectives with axis_index_groups are not emulated; use mesh axes instead")
    sizes = self.space.axis_sizes
    n = math.prod(sizes.get(a, 1) for a in axes)
    idx = self._site(eqn, kind, axes, [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars])
    with jax.named_scope(f"{MARKER}{idx}"):
      xs = jax.lax.optimization_barrier(list(invals))
      # Scalars hidden behind the barrier: XLA cannot fold 'x * 1' or 'x + 0' away, so every stand-in
      # leaves a real instruction (and output buffer) in the compiled program.
      if name in ("psum", "psum_invariant", "psum2"):
        outs = [x * _opaque(n, x.dtype) if x.dtype != jnp.bool_ else x for x in xs]
      elif name in ("pmax", "pmin", "ppermute"):
        outs = [x + _opaque(0, x.dtype) if x.dtype != jnp.bool_ else x for x in xs]
      elif kind == "all-gather":
        d = p["all_gather_dimension"]
        x = xs[0]
        outs = [jnp.concatenate([x] * n, axis=d) if p["tiled"] else jnp.stack([x] * n, axis=d)]
      elif kind == "reduce-scatter":
        d, x = p["scatter_dimension"], xs[0]
        pos = self.space.position(self.rank, axes)
        if p["tiled"]:
          chunk = x.shape[d] // n
          y = jax.lax.dynamic_slice_in_dim(x, pos * chunk, chunk, axis=d)
        else:
          y = jax.lax.index_in_dim(x, pos, axis=d, keepdims=False)
        outs = [y * _opaque(n, y.dtype)]
      elif kind == "all-to-all":
        if not p.get("tiled", False):
          raise NotImplementedError("untiled all_to_all is not emulated yet; use tiled=True")
        # Peer j sends this rank chunk[pos] of its data; identical peers -> chunk[pos] n times.
        x, sa = xs[0], p["split_axis"]
        chunk = x.shape[sa] // n
        mine = jax.lax.dynamic_slice_in_dim(x, self.space.position(self.rank, axes) * chunk, chunk, axis=sa)
        outs = [jnp.concatenate([mine] * n, axis=p["concat_axis"])]
      else:  # pragma: no cover - table and branches are kept in sync
        raise NotImplementedError(name)
      outs = jax.lax.optimization_barrier(outs)
    for o, v in zip(outs, eqn.outvars):
      if tuple(o.shape) != tuple(v.aval.shape) or o.dtype != v.aval.dtype:
        raise AssertionError(f"stand-in for {name} made {o.dtype}{o.shape}, expected {v.aval.dtype}{v.aval.shape}")
    return list(outs)

  # -------------------------------------------------------------- higher-order primitives
  def _hop_jit(self, eqn, invals):
    closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")  # closed_call names it call_jaxpr
    jaxpr, consts = (closed.jaxpr, closed.consts) if hasattr(closed, "consts") else (closed, ())
    return self.eval(jaxpr, consts, *invals)

  _hop_pjit = _hop_jit
  _hop_closed_call = _hop_jit

  def _hop_custom_jvp_call(self, eqn, invals):
    closed = eqn.params["call_jaxpr"]
    return self.eval(closed.jaxpr, closed.consts, *invals)

  def _hop_custom_vjp_call(self, eqn, invals):
    closed = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    return self.eval(closed.jaxpr, closed.consts, *invals)

  _hop_custom_vjp_call_jaxpr = _hop_custom_vjp_call

  def _hop_scan(self, eqn, invals):
    p = eqn.params
    closed, nc, nk = p["jaxpr"], p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

    def body(carry, x):
      outs = self.eval(closed.jaxpr, closed.consts, *consts, *carry, *x)
      return outs[:nk], outs[nk:]

    self._scope.append((f"scan[{p['length']}]", p["length"]))
    try:
      carry, ys = jax.lax.scan(body, list(init), list(xs), length=p["length"], reverse=p["reverse"],
                               unroll=p["unroll"])
    finally:
      self._scope.pop()
    return list(carry) + list(ys)

  def _hop_while(self, eqn, invals):
    p = eqn.params
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]

    def cond(c):
      return self.eval(cj.jaxpr, cj.consts, *cconsts, *c)[0]

    def body(c):
      return self.eval(bj.jaxpr, bj.consts, *bconsts, *c)

    self._scope.append(("while", 1))  # trip count unknown at trace time: counted once, see README
    try:
      return list(jax.lax.while_loop(cond, body, list(init)))
    finally:
      self._scope.pop()

  def _hop_cond(self, eqn, invals):
    branches = eqn.params["branches"]
    index, ops = invals[0], invals[1:]
    key = (tuple(self._path), id(eqn))
    if key not in self._cond_sites:
      self._cond_sites[key] = self.n_conds
      self.n_conds += 1
    cid = self._cond_sites[key]

    def make(i, b):
      def fn(*a):
        if self.count_branches:
          # Which branch really runs, per execution: the timeline walks only that branch (pipeline
          # ticks where a stage idles must not be charged the slot's compute or collectives).
          jax.debug.callback(self._hit, cid, i)
        return self.eval(b.jaxpr, b.consts, *a)
      return fn

    fns = [make(i, b) for i, b in enumerate(branches)]
    self._scope.append(("cond", 1))
    try:
      with jax.named_scope(f"{BRANCH_MARKER}{cid}"):
        return list(jax.lax.switch(index, fns, *ops))
    finally:
      self._scope.pop()

  def _hit(self, cid, i):
    self.branch_trace.setdefault(int(cid), []).append(int(i))

  def _hop_checkpoint(self, eqn, invals):
    p = eqn.params
    jaxpr = p["jaxpr"]

    def f(*a):
      return self.eval(jaxpr, (), *a)

    self._scope.append(("checkpoint", 1))
    try:
      return list(jax.checkpoint(f, prevent_cse=p.get("prevent_cse", True), policy=p.get("policy"))(*invals))
    finally:
      self._scope.pop()

  _hop_remat = _hop_checkpoint
  _hop_remat2 = _hop_checkpoint


def standin_program(closed: jcore.ClosedJaxpr, space: RankSpace, rank: int):
  """(fn, interpreter): ``fn(*flat_args)`` runs ``closed`` for ``rank`` with stand-in collectives;
  ``interpreter.records`` fill in when ``fn`` is first traced."""
  interp = Interpreter(space, rank)

  def fn(*args):
    return interp(closed, *args)

  return fn, interp


def marker_index(op_name: str) -> Optional[int]:
  m = re.search(MARKER + r"(\d+)", op_name or "")
  return int(m.group(1)) if m else None


def branch_marker(op_name: str) -> Optional[int]:
  """The cond site of a compiled ``conditional`` (innermost marker: nested conds carry their parents')."""
  m = re.findall(BRANCH_MARKER + r"(\d+)", op_name or "")
  return int(m[-1]) if m else None
