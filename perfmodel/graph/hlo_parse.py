"""Parser for XLA's HLO text (``compiled.as_text()``): the per-device program that really runs.

Why text and not the proto: jax 0.10 exposes no HLO-text -> proto entry point, but every backend
(CPU here, GPU/TPU via AOT) prints the same text grammar, so one parser serves all targets and golden
tests can be written by hand.

Covers what the performance model needs: computations and instructions (shapes, operands,
attributes, metadata op_name/source), fusions and their called computations, collectives (their replica groups:
perfmodel/graph/replica_groups.py), async ``*-start``/``*-done``
pairs and while loops with their trip counts (``known_trip_count`` in the backend config, else the
``i < N`` pattern of the condition).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Optional

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "bf16": 2, "f16": 2, "f32": 4,
    "f64": 8, "c64": 8, "c128": 16, "token": 0, "opaque": 0,
}

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")


@dataclasses.dataclass(frozen=True)
class ArrayShape:
  dtype: str
  dims: tuple

  @property
  def elements(self) -> int:
    return math.prod(self.dims)

  @property
  def bytes(self) -> float:
    return self.elements * DTYPE_BYTES.get(self.dtype, 4)


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  shapes: list  # list[ArrayShape]; a tuple-shaped result lists its leaves
  operands: list  # operand instruction names (without '%')
  attrs: dict  # raw attribute strings by key
  is_root: bool = False
  computation: str = ""
  line: str = dataclasses.field(default="", repr=False, compare=False)  # as printed (the profiler cuts it out)

  @property
  def out_bytes(self) -> float:
    return sum(s.bytes for s in self.shapes)

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.attrs.get("metadata", ""))
    return m.group(1) if m else ""

  def source(self, stack_frames: Optional[dict] = None) -> str:
    """'file:line' from source_file/source_line metadata, or the module's stack-frame table."""
    md = self.attrs.get("metadata", "")
    f, l = re.search(r'source_file="([^"]*)"', md), re.search(r"source_line=(\d+)", md)
    if f and l:
      return f"{f.group(1)}:{l.group(1)}"
    sf = re.search(r"stack_frame_id=(\d+)", md)
    return (stack_frames or {}).get(int(sf.group(1)), "") if sf else ""

  def called(self) -> list:
    """Names of computations this instruction calls (fusion body, loop body/cond, to_apply, branches)."""
    out = []
    for key in ("calls", "body", "condition", "to_apply", "branch_computations", "true_computation",
                "false_computation"):
      v = self.attrs.get(key)
      if v:
        out += [x.strip().lstrip("%") for x in v.strip("{}").split(",") if x.strip()]
    return out

  @property
  def minor_to_major(self) -> tuple:
    """Physical dimension order of the (first) result, minor-most first: '{0,2,1}' -> (0, 2, 1); a shape printed
    without a layout is row-major (XLA's default)."""
    m = re.search(r"[a-z][a-z0-9]*\[[^\]]*\]\{([\d,]*)", self.line.split(" = ", 1)[-1])
    if m and m.group(1):
      return tuple(int(x) for x in m.group(1).split(","))
    rank = len(self.shapes[0].dims) if self.shapes else 0
    return tuple(range(rank - 1, -1, -1))

  @property
  def backend_config(self) -> dict:
    raw = self.attrs.get("backend_config", "")
    if raw.startswith("{"):
      try:
        return json.loads(raw)
      except json.JSONDecodeError:
        return {}
    return {}


@dataclasses.dataclass
class Computation:
  name: str
  instructions: list  # program order (the text of a scheduled module is the schedule)
  is_entry: bool = False
  header: str = dataclasses.field(default="", repr=False, compare=False)  # the '%name (...) -> ... {' line

  def __post_init__(self):
    self.by_name = {i.name: i for i in self.instructions}

  @property
  def root(self) -> Instruction:
    for i in self.instructions:
      if i.is_root:
        return i
    return self.instructions[-1]


@dataclasses.dataclass
class Module:
  name: str
  computations: dict  # name -> Computation
  entry: str
  num_partitions: int = 1
  num_replicas: int = 1
  stack_frames: dict = dataclasses.field(default_factory=dict)

  @property
  def entry_computation(self) -> Computation:
    return self.computations[self.entry]


# ---------------------------------------------------------------- low-level text helpers

_COMMENT = re.compile(r"/\*.*?\*/")


def _match_close(s: str, i: int) -> int:
  """Index of the bracket closing the one at s[i] (handles nesting and quoted strings)."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack, j, quote = [], i, False
  while j < len(s):
    c = s[j]
    if quote:
      if c == "\\":
        j += 1
      elif c == '"':
        quote = False
    elif c == '"':
      quote = True
    elif c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return j
    j += 1
  raise ValueError(f"unbalanced brackets in HLO text: {s[i:i + 80]!r}")


def split_top(s: str, sep: str = ",") -> list:
  """Splits on `sep` outside brackets and quotes."""
  out, depth, quote, cur = [], 0, False, []
  i = 0
  while i < len(s):
    c = s[i]
    if quote:
      cur.append(c)
      if c == "\\" and i + 1 < len(s):
        cur.append(s[i + 1])
        i += 1
      elif c == '"':
        quote = False
    elif c == '"':
      quote = True
      cur.append(c)
    elif c in "([{":
      depth += 1
      cur.append(c)
    elif c in ")]}":
      depth -= 1
      cur.append(c)
    elif c == sep and depth == 0:
      out.append("".join(cur).strip())
      cur = []
    else:
      cur.append(c)
    i += 1
  if "".join(cur).strip():
    out.append("".join(cur).strip())
  return out


_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def parse_shape(text: str) -> list:
  """'f32[4,64]{1,0}' or a (nested) tuple of them -> list of ArrayShape leaves."""
  out = []
  for m in _ARRAY.finditer(_COMMENT.sub("", text)):
    dims = tuple(int(d.lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    out.append(ArrayShape(m.group(1), dims))
  # 'token[]' / 'pred[]' scalars are caught above; layouts '{1,0}' contain no dtype prefix.
  return out


# ---------------------------------------------------------------- instructions, computations, module

_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def parse_instruction(line: str, computation: str = "") -> Instruction:
  line = _COMMENT.sub("", line)
  m = _INSTR.match(line)
  if not m:
    raise ValueError(f"not an HLO instruction: {line[:120]!r}")
  is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3).strip()
  if rest.startswith("("):
    end = _match_close(rest, 0)
    shape_txt, rest = rest[:end + 1], rest[end + 1:].strip()
  else:
    shape_txt, rest = rest.split(None, 1) if " " in rest else (rest, "")
    # layouts may contain spaces in rare dumps ('{1,0:T(8,128)}'); keep everything up to the opcode.
  om = re.match(r"([\w\-]+)\(", rest)
  if not om:
    raise ValueError(f"cannot find the opcode of {name}: {rest[:80]!r}")
  opcode = om.group(1)
  open_i = om.end() - 1
  close_i = _match_close(rest, open_i)
  operand_txt = rest[open_i + 1:close_i]
  operands = re.findall(r"%([\w.\-]+)", operand_txt)
  if not operands and opcode not in ("constant", "parameter", "iota", "partition-id", "replica-id"):
    # Older dumps print operands without '%': 'add(f32[] x, f32[] y)' or 'add(x, y)'.
    operands = [p.split()[-1] for p in split_top(operand_txt) if p and not re.fullmatch(r"[-\d.e+]+", p.split()[-1])]
  attrs = {}
  tail = rest[close_i + 1:].lstrip(", ")
  for part in split_top(tail):
    if "=" in part:
      k, v = part.split("=", 1)
      attrs[k.strip()] = v.strip()
  if opcode == "parameter":
    attrs["parameter_number"] = operand_txt.strip()
  if opcode == "constant":
    attrs["literal"] = operand_txt.strip()
  return Instruction(name=name, opcode=opcode, shapes=parse_shape(shape_txt), operands=operands, attrs=attrs,
                     is_root=is_root, computation=computation, line=line)


def _source_tables(text: str) -> dict:
  """StackFrames id -> 'file:line (function)' from the FileNames/FunctionNames/FileLocations tables."""
  tables, cur = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}, None
  for line in text.splitlines():
    s = line.strip()
    if s in tables:
      cur = tables[s]
      continue
    if cur is None:
      continue
    m = re.match(r"(\d+)\s+(.*)$", s)
    if not m:
      if s.startswith(("%", "ENTRY")) or not s:
        cur = None if s else cur
      continue
    cur[int(m.group(1))] = m.group(2).strip().strip('"')
  frames = {}
  for fid, body in tables["StackFrames"].items():
    loc = re.search(r"file_location_id=(\d+)", body)
    locs = tables["FileLocations"].get(int(loc.group(1)), "") if loc else ""
    fn = re.search(r"file_name_id=(\d+)", locs)
    fu = re.search(r"function_name_id=(\d+)", locs)
    ln = re.search(r"\bline=(\d+)", locs)
    if fn and ln:
      frames[fid] = (f"{tables['FileNames'].get(int(fn.group(1)), '?')}:{ln.group(1)}"
                     f" ({tables['FunctionNames'].get(int(fu.group(1)), '?') if fu else '?'})")
  return frames


_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$|^(ENTRY\s+)?%([\w.\-]+)\s*\{\s*$")


def parse_module(text: str) -> Module:
  """Whole module text -> Module. Metadata tables (FileNames, StackFrames, ...) feed `source`."""
  comps, entry, cur, cur_name, cur_entry, cur_header = {}, None, None, "", False, ""
  header = text.lstrip().split("\n", 1)[0]
  mname = re.match(r"HloModule\s+([\w.\-]+)", header)
  nparts = re.search(r"num_partitions=(\d+)", header)
  nreps = re.search(r"replica_count=(\d+)", header)
  pending = []  # one instruction's lines: TPU prints some attributes (kernel_metadata) over several lines
  for raw in text.splitlines():
    line = raw.rstrip()
    if cur is None:
      m = _COMP.match(line)
      if m:
        cur, cur_header = [], line
        cur_entry = bool(m.group(1) or m.group(3))
        cur_name = m.group(2) or m.group(4)
      continue
    # a computation ends at a line '}' (TPU appends attributes to it: '}, execution_thread="sparsecore"')
    end = line.strip() == "}" or line.startswith("}, ")
    if end or (line.strip() and _INSTR.match(line)):
      if pending:
        cur.append(parse_instruction(" ".join(pending), cur_name))
        pending = []
    if end:
      comps[cur_name] = Computation(cur_name, cur, is_entry=cur_entry, header=cur_header)
      if cur_entry:
        entry = cur_name
      cur = None
      continue
    if line.strip():
      pending.append(line)
  if entry is None:
    raise ValueError("no ENTRY computation found: pass the text of compiled.as_text() (a whole HLO module)")
  mod = Module(name=mname.group(1) if mname else "module", computations=comps, entry=entry,
               num_partitions=int(nparts.group(1)) if nparts else 1,
               num_replicas=int(nreps.group(1)) if nreps else 1)
  mod.stack_frames = _source_tables(text)
  return mod


# ---------------------------------------------------------------- semantics used by the graph builder

def collective_kind(opcode: str) -> Optional[str]:
  """'all-reduce-start' -> 'all-reduce'; None for non-collectives."""
  base = re.sub(r"-(start|done|update)$", "", opcode)
  return base if base in COLLECTIVES else None


def async_role(opcode: str) -> Optional[str]:
  if opcode.endswith("-start") or opcode == "async-start":
    return "start"
  if opcode.endswith("-done") or opcode == "async-done":
    return "done"
  return None


def _const(comp: Computation, name: str) -> Optional[int]:
  ins = comp.by_name.get(name)
  try:
    return int(float(ins.attrs["literal"])) if ins is not None and ins.opcode == "constant" else None
  except ValueError:
    return None


def _compare(module: Module, comp: Computation):
  """(the computation holding the loop condition's compare, compare, enclosing fusion or None, fusion body)."""
  for ins in comp.instructions:
    if ins.opcode == "compare":
      return comp, ins, None, None
    sub = module.computations.get(ins.called()[0]) if ins.opcode == "fusion" else None
    found = _compare(module, sub) if sub is not None else None
    if found:
      return comp, found[1], ins, sub
  return None


def trip_count(module: Module, while_instr: Instruction) -> Optional[int]:
  """Trip count of a while loop: XLA's known_trip_count, else the `i < N` condition pattern (start and step from
  known_init_step, else from the loop's initial tuple and the body's increment: :func:`_induction`)."""
  bc = while_instr.backend_config
  n = bc.get("known_trip_count", {}).get("n")
  if n is not None:
    return int(n)
  cond = module.computations.get(while_instr.attrs.get("condition", "").lstrip("%"))
  found = _compare(module, cond) if cond is not None else None
  if not found:
    return None
  comp, cmp, fus, sub = found
  init = int(bc.get("known_init_step", {}).get("init", 0))
  step = int(bc.get("known_init_step", {}).get("step", 1))
  direction = re.search(r"(\w+)$", cmp.attrs.get("direction", "")).group(1)
  if fus is None:
    vals = [_const(comp, op) for op in cmp.operands]
    counter = comp.by_name.get(cmp.operands[0]) if cmp.operands else None
  else:  # compare inside a fusion: a parameter of the fusion stands for the caller's operand
    outer = lambda op: (fus.operands[int(sub.by_name[op].attrs["parameter_number"])]  # noqa: E731
                        if op in sub.by_name and sub.by_name[op].opcode == "parameter" else None)
    vals = [_const(comp, outer(op)) if outer(op) else _const(sub, op) for op in cmp.operands]
    counter = comp.by_name.get(outer(cmp.operands[0]) or "") if cmp.operands else None
  if "known_init_step" not in bc:
    init, step = _induction(module, while_instr, comp, counter, init, step)
  limit = vals[1] if len(vals) > 1 else None
  if limit is None:
    return None
  if direction == "LT":
    return max(0, math.ceil((limit - init) / step))
  if direction == "LE":
    return max(0, math.floor((limit - init) / step) + 1)
  return None


def _induction(module: Module, while_instr: Instruction, cond: Computation, counter: Optional[Instruction],
               init: int, step: int) -> tuple:
  """(init, step) of a loop counter the condition reads as tuple element k: its value in the while's initial
  tuple, and the constant the body adds to it (XLA:TPU's unrolled windowed-einsum loops step by 2)."""
  while counter is not None and counter.opcode in ("copy", "bitcast", "convert"):
    counter = cond.by_name.get(counter.operands[0])
  if counter is None or counter.opcode != "get-tuple-element":
    return init, step
  k = int(counter.attrs.get("index", -1))
  body = module.computations.get(while_instr.attrs.get("body", "").lstrip("%"))
  if body is not None and body.root.opcode == "tuple" and k < len(body.root.operands):
    upd = body.by_name.get(body.root.operands[k])
    if upd is not None and upd.opcode == "add":
      consts = [body.by_name.get(o) for o in upd.operands]
      c = [int(float(x.attrs["literal"])) for x in consts if x is not None and x.opcode == "constant"]
      step = c[0] if len(c) == 1 and c[0] > 0 else step
  caller = module.computations.get(while_instr.computation)
  tup = caller.by_name.get(while_instr.operands[0]) if caller is not None and while_instr.operands else None
  if tup is not None and tup.opcode == "tuple" and k < len(tup.operands) and _const(caller, tup.operands[k]) is not None:
    init = _const(caller, tup.operands[k])
  return init, step
