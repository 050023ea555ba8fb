"""Slicing: which ranks of the target mesh run *different* programs, and who represents each.

In an SPMD step every rank runs the same per-device program; only ``axis_index`` values differ. A
rank's coordinate along an axis changes *what runs* (not just which numbers flow) only if the value of
``axis_index(axis)`` reaches control flow: the index of a ``cond``/``switch`` or the predicate of a
``while``. :func:`structural_axes` finds those axes by taint propagation through the per-device jaxpr
(into and out of scan/while/cond/jit/remat bodies, conservatively). Axes that only feed arithmetic
(sequence-parallel position offsets, the vocab shard of the tensor-parallel loss) give every rank the
same program up to constants, so they do not split classes.

Along a structural axis the classes are first / middle / last (pipeline stage 0 embeds, the last
stage computes the head and loss, middle stages only run layers); all middle positions are taken to
run the same program, which holds for schedules whose branches test ``stage == 0`` / ``stage == p-1``
(stated as an assumption in the output). The product over structural axes gives the classes; each is
represented by one real rank.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional, Sequence

from jax.extend import core as jcore

from perfmodel.emulate.standins import _sub_jaxprs
from perfmodel.emulate.topology import RankSpace

CONTROL = ("cond", "while")


def _taint_eval(jaxpr, in_taint: list, found: set) -> list:
  """Propagates sets of axis names from axis_index through ``jaxpr``; adds to ``found`` the axes that
  reach control flow. Returns the taint of the outputs."""
  env = {}
  for v, t in zip(jaxpr.invars, in_taint):
    env[v] = frozenset(t)
  get = lambda v: frozenset() if isinstance(v, jcore.Literal) else env.get(v, frozenset())  # noqa: E731
  for e in jaxpr.eqns:
    name = e.primitive.name
    ins = [get(v) for v in e.invars]
    union = frozenset().union(*ins) if ins else frozenset()
    if name == "axis_index":
      an = e.params["axis_name"]
      out = frozenset((an,) if isinstance(an, str) else an)
      outs = [out] * len(e.outvars)
    elif name == "cond":
      found.update(ins[0])
      outs = []
      for br in e.params["branches"]:
        outs.append(_taint_eval(br.jaxpr, ins[1:], found))
      outs = [frozenset().union(*col) for col in zip(*outs)] if outs else []
      outs = [o | ins[0] for o in outs]
    elif name == "while":
      p = e.params
      cn, bn = p["cond_nconsts"], p["body_nconsts"]
      cconst, bconst, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
      for _ in range(3):  # fixed point over the carry (taints only grow)
        new = _taint_eval(p["body_jaxpr"].jaxpr, bconst + carry, found)
        merged = [a | b for a, b in zip(carry, new)]
        if merged == carry:
          break
        carry = merged
      pred = _taint_eval(p["cond_jaxpr"].jaxpr, cconst + carry, found)
      found.update(*pred)
      outs = [c | frozenset().union(*pred) for c in carry]
    else:
      subs = _sub_jaxprs(e.params)
      if subs and name == "scan":
        p = e.params
        nc, nk = p["num_consts"], p["num_carry"]
        consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        body = p["jaxpr"].jaxpr
        for _ in range(3):
          new = _taint_eval(body, consts + carry + xs, found)
          merged = [a | b for a, b in zip(carry, new[:nk])]
          if merged == carry:
            break
          carry = merged
        outs = carry + [frozenset().union(*new[nk:], *carry)] * (len(e.outvars) - nk) if len(e.outvars) > nk else carry
      elif subs and len(subs[0].invars) == len(ins):
        outs = _taint_eval(subs[0], ins, found)
      else:
        for sj in subs:
          _taint_eval(sj, [union] * len(sj.invars), found)
        outs = [union] * len(e.outvars)
    for v, t in zip(e.outvars, outs):
      env[v] = t
  return [get(v) for v in jaxpr.outvars]


def structural_axes(closed: jcore.ClosedJaxpr) -> tuple:
  found: set = set()
  _taint_eval(closed.jaxpr, [frozenset()] * len(closed.jaxpr.invars), found)
  return tuple(sorted(found))


def _role(pos: int, size: int) -> str:
  if size == 1:
    return "only"
  return "first" if pos == 0 else ("last" if pos == size - 1 else "middle")


@dataclasses.dataclass(frozen=True)
class RankClass:
  key: tuple  # ((axis, role), ...) over structural axes; () = every rank
  representative: int  # global rank id that runs for real
  count: int  # ranks in the class
  chosen_by: str  # 'auto' | 'user'

  @property
  def label(self) -> str:
    return ",".join(f"{a}:{r}" for a, r in self.key) or "all"


@dataclasses.dataclass(frozen=True)
class Slicing:
  space: RankSpace
  structural: tuple
  classes: tuple  # RankClass
  assumption: str

  def class_of(self, rank: int) -> RankClass:
    c = self.space.coords(rank)
    key = tuple((a, _role(c[a], self.space.axis_sizes[a])) for a in self.structural)
    for k in self.classes:
      if k.key == key:
        return k
    raise KeyError(key)


def slice_ranks(closed: jcore.ClosedJaxpr, space: RankSpace, ranks: Optional[Sequence[int]] = None) -> Slicing:
  """Classes of ranks with distinct programs; one representative each (the user's ranks first)."""
  sizes = space.axis_sizes
  structural = tuple(a for a in structural_axes(closed) if sizes.get(a, 1) > 1)
  roles = [[(a, r) for r in dict.fromkeys(_role(p, sizes[a]) for p in range(sizes[a]))] for a in structural]
  user = {}
  for r in ranks or ():
    c = space.coords(r)
    key = tuple((a, _role(c[a], sizes[a])) for a in structural)
    user.setdefault(key, r)
  classes = []
  for key in itertools.product(*roles) if structural else [()]:
    counts = []
    coords = {a: 0 for a in sizes}
    for a, role in key:
      n = sizes[a]
      counts.append({"first": 1, "last": 1, "middle": n - 2, "only": 1}[role])
      coords[a] = {"first": 0, "last": n - 1, "middle": 1, "only": 0}[role]
    count = space.n // math.prod(sizes[a] for a in structural) * math.prod(counts) if structural else space.n
    rep = user.get(key, space.rank(coords))
    classes.append(RankClass(key=tuple(key), representative=rep, count=count,
                             chosen_by="user" if key in user else "auto"))
  assumption = ("all ranks run one program (no axis_index reaches control flow)" if not structural else
                f"axis_index of {', '.join(structural)} reaches control flow: classes first/middle/last per axis; "
                f"all middle positions are assumed to run the same program")
  return Slicing(space=space, structural=structural, classes=tuple(classes), assumption=assumption)
