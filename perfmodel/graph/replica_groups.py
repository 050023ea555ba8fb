"""Replica groups of a collective in HLO text, in all three formats XLA prints: explicit ``{{0,1},{2,3}}``, iota
``[4,2]<=[8]`` with an optional ``T(perm)``, and Shardy mesh-axes ``mesh['a'=4,'b'=2] {'b'}``; and a
collective-permute's ``source_target_pairs``."""
from __future__ import annotations

import math
import re
from typing import Optional

import numpy as np

from perfmodel.graph.hlo_parse import _match_close, split_top


def _iota_groups(text: str) -> list:
  """'[G,S]<=[d0,d1,...]T(p...)': iota over the reshape dims, transposed, reshaped to G x S."""
  m = re.fullmatch(r"\s*\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?\s*", text)
  if not m:
    raise ValueError(f"not an iota replica group: {text!r}")
  out_dims = [int(x) for x in m.group(1).split(",")]
  reshape = [int(x) for x in m.group(2).split(",")]
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  if m.group(3):
    ids = ids.transpose([int(x) for x in m.group(3).split(",")])
  ids = ids.reshape(out_dims)
  if ids.ndim == 1:
    ids = ids[None]
  return [tuple(int(x) for x in row) for row in ids.reshape(ids.shape[0], -1)]


def _mesh_groups(text: str) -> list:
  """Shardy mesh-axes format: "mesh['a'=4,'b'=2] {'b'}" (sub-axes "'a':(1)2" allowed).

  Devices are numbered row-major over the mesh (an explicit device_ids list, when printed, remaps
  them). A group is the set of devices that differ only along the listed axes."""
  m = re.match(r"\s*mesh\[(.*?)\]\s*\{(.*)\}\s*$", text, re.S)
  if not m:
    # Seen in jax 0.10.2 CPU HLO of a data x fsdp x tensor jit step: "mesh['axis_0'=1,'axis_1'=2,'axis_2'=4]"
    # with no axis list. Read as every axis (one group of the whole mesh), the only non-trivial reading.
    bare = re.match(r"\s*mesh\[(.*)\]\s*$", text, re.S)
    if not bare:
      raise ValueError(f"not a mesh replica group: {text!r}")
    names = [am.group(1) for am in re.finditer(r"'?([\w.]+)'?\s*=\s*\d+", bare.group(1))]
    text = f"mesh[{bare.group(1)}] {{{','.join(repr(n) for n in names)}}}"
    m = re.match(r"\s*mesh\[(.*?)\]\s*\{(.*)\}\s*$", text, re.S)
  axes, device_ids = [], None
  for part in split_top(m.group(1)):
    am = re.fullmatch(r"'?([\w.]+)'?\s*=\s*(\d+)", part.strip())
    if am:
      axes.append((am.group(1), int(am.group(2))))
    elif "device_ids" in part:
      device_ids = [int(x) for x in re.findall(r"\d+", part.split("=", 1)[1])]
  # Expand sub-axes: 'a':(pre)size splits axis a into [pre, size, rest].
  names = [a for a, _ in axes]
  sizes = dict(axes)
  selected = []  # list of (axis, pre, size)
  for part in split_top(m.group(2)):
    part = part.strip()
    if not part:
      continue
    sm = re.fullmatch(r"'?([\w.]+)'?(?::\((\d+)\)(\d+))?", part)
    if not sm:
      raise ValueError(f"cannot read replica-group axis {part!r} in {text!r}")
    a = sm.group(1)
    pre, sz = (int(sm.group(2)), int(sm.group(3))) if sm.group(2) else (1, sizes[a])
    selected.append((a, pre, sz))
  dims, labels = [], []
  for a in names:
    subs = sorted((p, s) for (x, p, s) in selected if x == a)
    if not subs:
      dims.append(sizes[a]); labels.append(False)
      continue
    cur = 1
    for p, s in subs:
      if p > cur:
        dims.append(p // cur); labels.append(False)
      dims.append(s); labels.append(True)
      cur = p * s
    if sizes[a] > cur:
      dims.append(sizes[a] // cur); labels.append(False)
  ids = np.arange(math.prod(dims)).reshape(dims)
  if device_ids is not None:
    ids = np.asarray(device_ids)[ids]
  keep = [i for i, l in enumerate(labels) if not l]
  group = [i for i, l in enumerate(labels) if l]
  ids = ids.transpose(keep + group).reshape(math.prod(dims[i] for i in keep) if keep else 1, -1)
  return [tuple(int(x) for x in row) for row in ids]


def parse_replica_groups(text: Optional[str], n_devices: int = 1) -> list:
  """Any of the three formats -> list of device-id tuples. Empty ('{}') means one group of all."""
  if text is None:
    return [tuple(range(n_devices))]
  t = text.strip()
  if t.startswith("mesh"):
    return _mesh_groups(t)
  if t.startswith("["):
    return _iota_groups(t)
  if t.startswith("{"):
    inner = t[1:_match_close(t, 0)].strip()
    if not inner:
      return [tuple(range(n_devices))]
    return [tuple(int(x) for x in re.findall(r"-?\d+", g)) for g in re.findall(r"\{([^{}]*)\}", inner)]
  raise ValueError(f"unknown replica_groups format {text!r}: expected '{{...}}', '[G,S]<=[N]' or \"mesh[...] {{...}}\"")


def parse_pairs(text: str) -> list:
  """source_target_pairs={{0,1},{1,2}} -> [(0,1),(1,2)]."""
  return [tuple(int(x) for x in g.split(",")) for g in re.findall(r"\{(\d+,\s*\d+)\}", text)]
