"""The profiled database's key for an execution-graph node: suffixes added over time, and the older forms.

`graph._Builder` writes a node's fingerprint (kind, opcode, shapes, flops, transcendentals, bytes; a dot's
batch/m/n/k) and appends these; stored samples and database entries written by older code carry the shorter
forms, which `legacy_fingerprint` / `without_structure` give back so they can still be matched (perfmodel/refit.py).
"""
from __future__ import annotations

import hashlib
import re

FP_TAGS = ("|plain", "|minor")  # fingerprint suffixes added in session 14 (earlier samples lack them)
_STRUCTURE = re.compile(r"\|s[0-9a-f]{8}$")


def structure_tag(body) -> str:
  """`|s` + 8 hex digits of a hash of a fusion's fused-computation opcode sequence (added in session 24).

  Kind, opcode, output shape, flops and bytes do not tell fusions apart: a KV-cache dynamic-update-slice and a
  broadcast filling the whole cache shared one profiled-database entry and so one alone time (28.7 vs 13 us;
  perfmodel/JOURNAL.md, session 23; benchmarks/fingerprint_collisions.py counts such keys)."""
  seq = ";".join(i.opcode for i in body.instructions)
  return "|s" + hashlib.sha1(seq.encode()).hexdigest()[:8]


def without_structure(fp: str) -> str:
  """A fingerprint as written before `structure_tag` (sessions 14-23's stored samples and database entries)."""
  return _STRUCTURE.sub("", fp)


def legacy_fingerprint(fp: str) -> str:
  """A fingerprint as written before the FP_TAGS suffixes and the structure tag (the oldest stored samples)."""
  fp = without_structure(fp)
  for tag in FP_TAGS:
    fp = fp.replace(tag, "")
  return fp
