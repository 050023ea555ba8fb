"""What a program's data movement does (perfmodel/graph/from_hlo.py): whether a layout change moves the minor-most
dimension (``Node.moves_minor``), whether a node only picks or stores one slice of a stacked array (``Node.indexing``)."""
from __future__ import annotations

import re

from perfmodel.graph import hlo_parse as hp


def _minor_dim(dims: tuple, minor_to_major: tuple):
  """The minor-most physical dimension of size > 1 (None: a scalar-like array)."""
  return next((d for d in minor_to_major if d < len(dims) and dims[d] > 1), None)


def _moves_minor_one(ins: hp.Instruction, comp: hp.Computation) -> bool:
  """Whether a copy/transpose instruction reads its result's minor-most dimension from a dimension that is not
  the operand's minor-most one (a strided gather rather than a copy of contiguous runs)."""
  src = comp.by_name.get(ins.operands[0]) if ins.operands else None
  if src is None or not src.shapes or not ins.shapes:
    return False
  out_minor = _minor_dim(ins.shapes[0].dims, ins.minor_to_major)
  in_minor = _minor_dim(src.shapes[0].dims, src.minor_to_major)
  if out_minor is None or in_minor is None:
    return False
  if ins.opcode == "transpose":
    perm = [int(x) for x in re.findall(r"\d+", ins.attrs.get("dimensions", ""))]
    out_minor = perm[out_minor] if out_minor < len(perm) else out_minor
  return out_minor != in_minor


def moves_minor(module: hp.Module, ins: hp.Instruction, comp: hp.Computation) -> bool:
  """A copy/transpose, or a fusion with one inside, that moves the minor-most dimension (Node.moves_minor)."""
  if ins.opcode in ("copy", "transpose"):
    return _moves_minor_one(ins, comp)
  if ins.opcode == "fusion" and ins.called() and ins.called()[0] in module.computations:
    body = module.computations[ins.called()[0]]
    return any(_moves_minor_one(i, body) for i in body.instructions if i.opcode in ("copy", "transpose"))
  return False


_MOVES = {"parameter", "constant", "bitcast", "reshape", "copy", "tuple", "get-tuple-element", "slice", "pad",
          "dynamic-slice", "dynamic-update-slice"}


def _moves(i: hp.Instruction, body: hp.Computation) -> bool:
  """Whether a fused instruction only moves arrays: a select by one scalar predicate (a masked write) chooses one."""
  if i.opcode in _MOVES or sum(s.elements for s in i.shapes) <= 1:
    return True
  if i.opcode == "broadcast":
    return i.shapes[0].dtype == "pred" and sum(s.elements for s in body.by_name[i.operands[0]].shapes) <= 1
  return i.opcode == "select" and getattr(body.by_name.get(i.operands[0]), "opcode", "") == "broadcast"


def indexes(module: hp.Module, ins: hp.Instruction) -> bool:
  """Node.indexing: a dynamic-slice / -update-slice, or a fusion whose arrays only move through them (arithmetic
  on scalar indices only), or the pad XLA makes of an update into a zeroed buffer: picking or storing one layer's
  (one tick's) slice of a stacked array."""
  if ins.opcode in ("dynamic-slice", "dynamic-update-slice"):
    return True
  body = module.computations.get(ins.called()[0]) if ins.opcode == "fusion" and ins.called() else None
  if body is None or not all(_moves(i, body) for i in body.instructions):
    return False
  return (any(i.opcode in ("dynamic-slice", "dynamic-update-slice") for i in body.instructions)
          or (body.root.opcode == "pad" and ins.op_name.endswith("dynamic_update_slice")))
