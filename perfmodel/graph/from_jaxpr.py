"""Execution graph of one rank's *real* per-device program at any scale, from its jaxpr (no compile).

Where the target mesh cannot be compiled on this host (XLA:CPU refuses 8192 virtual devices: "Multiprocess
computations aren't implemented on the CPU backend"), predict takes the same per-rank program the emulator
runs: ``perfmodel.program.rank_program`` traces the shard_map step's per-device body on an AbstractMesh of
the target sizes (per-rank shapes, explicit collectives with their mesh axes). This module turns that jaxpr
into the shared :class:`perfmodel.graph.nodes.ExecGraph`:

* ``dot_general`` -> ``dot`` node (m, n, k, batch, dtype from the dimension numbers);
* collectives (psum/pmax/pmin -> all-reduce, all_gather, psum_scatter -> reduce-scatter, all_to_all,
  ppermute) -> ``collective`` nodes with iota replica groups of their mesh axes (same as analytic graphs);
* ``scan`` -> ``loop`` with trip = length; ``while`` -> loop of one trip (unknown; flagged in ``notes``);
  ``cond`` -> its most expensive branch (an upper bound; flagged);
* nested calls (jit, remat, custom_jvp/vjp) are inlined;
* runs of other primitives between those become one ``fusion`` node, like XLA would fuse them: bytes =
  inputs read from outside the run + values the run produces that are used after it; flops = elements.
What the jaxpr does not show is XLA's own fusion decisions and copies, so fusion bytes are approximate;
dots and collectives are exact per rank.
"""
from __future__ import annotations

import itertools
import math

from jax.extend import core as jcore

from framework.config import MESH_AXES
from perfmodel.graph import analytic
from perfmodel.graph.nodes import Attribution, CollectiveInfo, DotInfo, ExecGraph, Node, Region

_DT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32"}
_TRANS = {"exp", "log", "tanh", "logistic", "rsqrt", "sqrt", "sin", "cos", "pow", "erf", "exp2", "log1p", "expm1"}
_FREE = {"pvary", "stop_gradient", "axis_index", "iota"}
_COLL = {"psum": "all-reduce", "psum_invariant": "all-reduce", "pmax": "all-reduce", "pmin": "all-reduce",
         "all_gather": "all-gather", "all_gather_invariant": "all-gather", "reduce_scatter": "reduce-scatter",
         "psum_scatter": "reduce-scatter", "all_to_all": "all-to-all", "ppermute": "collective-permute"}


def _bytes(v) -> float:
  aval = getattr(v, "aval", None)
  if aval is None or not hasattr(aval, "shape"):
    return 0.0
  return float(math.prod(aval.shape)) * getattr(aval.dtype, "itemsize", 4)


def _elems(v) -> float:
  aval = getattr(v, "aval", None)
  return float(math.prod(aval.shape)) if aval is not None and hasattr(aval, "shape") else 0.0


def _axes(params) -> tuple:
  a = params.get("axes", params.get("axis_name", ()))
  a = (a,) if isinstance(a, str) else tuple(a)
  return tuple(x for x in a if isinstance(x, str))


class _Builder:
  def __init__(self, sizes: dict):
    self.sizes = sizes
    self.n = math.prod(sizes.values())
    self.ids = itertools.count()
    self.regions = {}
    self.notes = set()
    self.rc = itertools.count()

  def region(self, jaxpr, name: str) -> str:
    nodes = []
    self._emit(jaxpr, nodes)
    self.regions[name] = Region(name, nodes)
    return name

  def _add(self, nodes, **kw):
    kw.setdefault("deps", (nodes[-1].id,) if nodes else ())
    nodes.append(Node(id=next(self.ids), **kw))

  def _emit(self, jaxpr, nodes):
    uses = {}
    for i, e in enumerate(jaxpr.eqns):
      for v in e.invars:
        if not isinstance(v, jcore.Literal):
          uses.setdefault(v, []).append(i)
    outs = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    group = []  # indices of pending elementwise eqns

    def flush(end):
      if not group:
        return
      produced = {v for i in group for v in jaxpr.eqns[i].outvars}
      reads = {v for i in group for v in jaxpr.eqns[i].invars
               if not isinstance(v, jcore.Literal) and v not in produced}
      writes = {v for v in produced if v in outs or any(u >= end for u in uses.get(v, ()))}
      flops = trans = 0.0
      for i in group:
        e = jaxpr.eqns[i]
        el = sum(_elems(o) for o in e.outvars)
        if e.primitive.name in _TRANS:
          trans += el
        elif e.primitive.name.startswith("reduce_"):
          flops += sum(_elems(v) for v in e.invars)
        elif e.primitive.name not in ("broadcast_in_dim", "reshape", "convert_element_type", "transpose", "squeeze",
                                      "concatenate", "slice", "dynamic_slice", "dynamic_update_slice", "select_n",
                                      "gather", "pad", "expand_dims", "copy", "copy_p"):
          flops += el
      nb = sum(_bytes(v) for v in reads) + sum(_bytes(v) for v in writes)
      names = [jaxpr.eqns[i].primitive.name for i in group]
      self._add(nodes, name=f"jfusion.{len(nodes)}", kind="fusion", opcode="fusion:jaxpr", flops=flops,
                transcendentals=trans, bytes=nb, out_bytes=sum(_bytes(v) for v in writes),
                attribution=Attribution(op_name="/".join(names[:4]), op=names[-1]),
                fingerprint=f"jfusion|b{int(nb)}|f{int(flops)}|t{int(trans)}")
      group.clear()

    for i, e in enumerate(jaxpr.eqns):
      name = e.primitive.name
      if name in _FREE:
        continue
      if name == "dot_general":
        flush(i)
        self._dot(e, nodes)
      elif name in _COLL:
        flush(i)
        self._coll(e, nodes, _COLL[name])
      elif name == "scan":
        flush(i)
        body = self.region(e.params["jaxpr"].jaxpr, f"scan.{next(self.rc)}")
        self._add(nodes, name=body, kind="loop", opcode="while", body=body, trip_count=int(e.params["length"]),
                  attribution=Attribution(op_name="scan", op="scan"))
      elif name == "while":
        flush(i)
        self.notes.add("a while loop of unknown trip count is priced as one trip")
        body = self.region(e.params["body_jaxpr"].jaxpr, f"while.{next(self.rc)}")
        self._add(nodes, name=body, kind="loop", opcode="while", body=body, trip_count=1,
                  attribution=Attribution(op_name="while", op="while"), fingerprint="unknown_trip_count")
      elif name == "cond":
        flush(i)
        self.notes.add("cond priced by its most expensive branch (upper bound)")
        best, best_flops = None, -1.0
        for br in e.params["branches"]:
          rn = self.region(br.jaxpr, f"cond.{next(self.rc)}")
          f = sum(n.flops for n in self.regions[rn].nodes)
          if f > best_flops:
            best, best_flops = rn, f
        self._add(nodes, name=best, kind="loop", opcode="conditional", body=best, trip_count=1,
                  attribution=Attribution(op_name="cond", op="cond"))
      else:
        subs = [p.jaxpr if isinstance(p, jcore.ClosedJaxpr) else p for p in e.params.values()
                if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))]
        if subs:
          flush(i)
          self._emit(subs[0], nodes)  # inline jit / remat / custom_jvp / custom_vjp bodies
        else:
          group.append(i)
    flush(len(jaxpr.eqns))

  def _dot(self, e, nodes):
    (lc, _), (lb, _) = e.params["dimension_numbers"]
    lhs = e.invars[0].aval.shape
    out = e.outvars[0]
    k = math.prod(lhs[d] for d in lc)
    b = math.prod(lhs[d] for d in lb)
    m = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
    n = max(1, int(_elems(out)) // max(1, b * m))
    dt = _DT.get(str(out.aval.dtype), "f32")
    nb = sum(_bytes(v) for v in e.invars) + _bytes(out)
    self._add(nodes, name=f"dot.{len(nodes)}", kind="dot", opcode="dot", flops=2.0 * b * m * n * k, bytes=nb,
              out_bytes=_bytes(out), dot=DotInfo(m=m, n=n, k=k, batch=b, dtype=dt),
              attribution=Attribution(op_name="dot_general", op="dot_general"),
              fingerprint=f"dot|{dt}|b{b}m{m}n{n}k{k}|extra_f0")

  def _coll(self, e, nodes, kind):
    axes = tuple(a for a in _axes(e.params) if self.sizes.get(a, 1) > 1)
    size = math.prod(self.sizes[a] for a in axes) if axes else 1
    if size <= 1:
      return
    inb = sum(_bytes(v) for v in e.invars)
    outb = sum(_bytes(v) for v in e.outvars)
    payload = {"all-gather": outb, "reduce-scatter": inb}.get(kind, inb)
    text = analytic.axis_groups_text(self.sizes, axes) if kind != "collective-permute" else ""
    info = CollectiveInfo(kind=kind, group_size=size, n_groups=self.n // size, bytes=payload, groups_text=text,
                          is_async=False, n_devices=self.n)
    self._add(nodes, name=f"{kind}.{len(nodes)}", kind="p2p" if kind == "collective-permute" else "collective",
              opcode=kind, bytes=payload, out_bytes=outb, collective=info,
              attribution=Attribution(op_name=f"{kind}({','.join(axes)})", op=kind),
              fingerprint=f"{kind}|{size}|{int(payload)}")


def build(closed: jcore.ClosedJaxpr, sizes: dict, extra_entry_nodes=()) -> tuple:
  """(ExecGraph, notes) of a per-device jaxpr on a mesh of ``sizes`` (MESH_AXES order)."""
  sizes = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
  b = _Builder(sizes)
  b.region(closed.jaxpr, "entry")
  entry = b.regions["entry"].nodes
  for kw in extra_entry_nodes:
    b._add(entry, **kw)  # noqa: SLF001
  return ExecGraph(regions=b.regions, entry="entry", n_devices=b.n, module_name="rank_program"), sorted(b.notes)
