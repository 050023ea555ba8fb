"""Byte layout of one process's shards of a train-state pytree, and pack / unpack.

A snapshot is what orbax would write for this process: every leaf's addressable shards (one per
local device), concatenated at 64-byte-aligned offsets. Replicated leaves are stored by every
process (each restores its own copy). The layout is a pure function of (abstract state with
shardings, process), so the process that takes over a rank after a swap computes the same layout
and reads the replica that its buddy kept.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Piece:
  leaf: int  # index in tree_flatten order
  device_id: int
  index: tuple  # slices of the global array held by this shard
  shape: tuple
  dtype: Any  # numpy dtype object (bfloat16 has no portable .str)
  offset: int
  nbytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
  pieces: tuple
  nbytes: int
  treedef: Any
  global_shapes: tuple
  shardings: tuple


def _align(n: int, a: int = 64) -> int:
  return (n + a - 1) // a * a


def make(abstract_state) -> Layout:
  """Layout of this process's local shards; abstract_state leaves carry ``.sharding``."""
  leaves, treedef = jax.tree.flatten(abstract_state)
  pieces: List[Piece] = []
  off = 0
  for i, leaf in enumerate(leaves):
    sh = leaf.sharding
    idx_map = sh.addressable_devices_indices_map(leaf.shape)
    for dev in sorted(idx_map, key=lambda d: d.id):
      index = idx_map[dev]
      shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, leaf.shape))
      nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
      pieces.append(Piece(i, dev.id, tuple((s.start, s.stop, s.step) for s in index), shape,
                          np.dtype(leaf.dtype), off, nbytes))
      off = _align(off + nbytes)
  return Layout(tuple(pieces), off, treedef, tuple(l.shape for l in leaves), tuple(l.sharding for l in leaves))


def pack(state, layout: Layout, dst_u8: np.ndarray) -> None:
  """Copies this process's shards of ``state`` into ``dst_u8`` (preallocated, reused)."""
  leaves = jax.tree.leaves(state)
  by_leaf = {}
  for p in layout.pieces:
    by_leaf.setdefault(p.leaf, []).append(p)
  for i, ps in by_leaf.items():
    shards = {s.device.id: s for s in leaves[i].addressable_shards}
    for p in ps:
      src = np.asarray(shards[p.device_id].data)  # zero-copy host view on CPU; a D2H copy on GPU
      dst = dst_u8[p.offset:p.offset + p.nbytes].view(src.dtype).reshape(src.shape)
      np.copyto(dst, src)


def unpack(src_u8: np.ndarray, layout: Layout):
  """Rebuilds the global (sharded) state from this process's bytes; copies out of shared memory."""
  devices = {d.id: d for d in jax.local_devices()}
  per_leaf = [[] for _ in layout.shardings]
  for p in layout.pieces:
    arr = np.array(src_u8[p.offset:p.offset + p.nbytes].view(p.dtype).reshape(p.shape), copy=True)
    per_leaf[p.leaf].append(jax.device_put(arr, devices[p.device_id]))
  leaves = [jax.make_array_from_single_device_arrays(shape, sh, arrs)
            for shape, sh, arrs in zip(layout.global_shapes, layout.shardings, per_leaf)]
  return jax.tree.unflatten(layout.treedef, leaves)
