"""A compiled program's HLO text -> its execution graph (perfmodel/graph/nodes.py).

Every instruction that does work becomes a node with its flops, transcendentals and bytes (HloCostAnalysis
conventions); free ops (parameter, constant, tuple, get-tuple-element, bitcast, partition-id, ...) make no node and
the dependencies flow through them. While loops and calls become ``loop`` nodes over a region of their own, a
conditional a ``loop`` node with every branch as a region, async ``*-start`` / ``*-done`` pairs a collective node
and a ``wait`` node. Each compute node gets a ``fingerprint``: its key in the profiled database.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from typing import Optional

import numpy as np

from perfmodel.graph import hlo_parse as hp
from perfmodel.graph.movement import indexes, moves_minor
from perfmodel.graph.nodes import (Attribution, CollectiveInfo, DotInfo, ExecGraph, Node, Region,
                                   mark_program_bytes, parse_groups)

FREE_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id",
            "after-all", "opt-barrier", "add-dependency", "iota", "domain", "get-dimension-size"}
TRANSCENDENTAL = {"exponential", "exp", "log", "tanh", "rsqrt", "sqrt", "logistic", "sine", "cosine", "power",
                  "exponential-minus-one", "log-plus-one", "erf", "atan2", "cbrt", "tan"}
NO_FLOP = FREE_OPS | {"broadcast", "reshape", "transpose", "copy", "slice", "dynamic-slice", "dynamic-update-slice",
                      "concatenate", "pad", "gather", "scatter", "reverse", "convert", "select"}
# Asynchronous copies between memory spaces (TPU: HBM <-> on-chip memory, prefetches the scheduler overlaps with
# compute); the HBM traffic is the bytes of the instructions that read or write the copied buffers.
ASYNC_COPIES = ("copy-start", "copy-done")
# XLA:TPU's async collective fusions: a fusion whose root custom-call starts (or finishes) the collective fused in
# it; the TensorCore computes while the transfer runs (libtpu: xla_tpu_enable_async_collective_fusion)
TPU_ASYNC = ("AsyncCollectiveStart", "AsyncCollectiveDone")
WINDOWED_BODY = "windowed_dot_general_body"  # computations of XLA's windowed einsum (collective matmul) loops
# custom-calls that allocate or annotate and do no work of their own (TPU)
NO_WORK_CALLS = {"AllocateBuffer", "AssumeGatherIndicesInBound", "GatherScatterIndicesBitpacked", "Sharding",
                 "SPMDFullToShardShape", "SPMDShardToFullShape", "MoveToHost", "MoveToDevice"}
# Fingerprint suffixes: nodes that run at different speeds must not share a profiled-database entry. A dot XLA
# emits itself ran about 2x slower than a library dot of the same m, n, k on this CPU, and a layout change that
# moves the minor-most dimension 2-4.5x slower per byte than one that keeps it.
FP_PLAIN, FP_MINOR = "|plain", "|minor"


def structure_tag(body: hp.Computation) -> str:
  """``|s`` + 8 hex digits of a hash of a fusion's fused opcode sequence: kind, opcode, output shape, flops and
  bytes do not tell fusions apart (a KV-cache update and a broadcast filling the cache looked the same)."""
  seq = ";".join(i.opcode for i in body.instructions)
  return "|s" + hashlib.sha1(seq.encode()).hexdigest()[:8]


def conditional_branches(module: hp.Module, ins: hp.Instruction) -> list:
  """Branch computations of a conditional, indexed like ``lax.switch`` (pred form: [false, true])."""
  a = ins.attrs
  if "true_computation" in a:
    strip = lambda v: v.strip().lstrip("%")  # noqa: E731
    return [strip(a["false_computation"]), strip(a["true_computation"])]
  return [c for c in ins.called() if c in module.computations]


# ---------------------------------------------------------------- costs of HLO instructions

def _dot_info(ins: hp.Instruction, comp: hp.Computation) -> tuple:
  """(flops, DotInfo) of a dot: 2 * output elements * contracted size."""
  out = ins.shapes[0]
  lhs = comp.by_name.get(ins.operands[0])
  lhs_dims = lhs.shapes[0].dims if lhs is not None and lhs.shapes else ()
  contract = [int(x) for x in re.findall(r"\d+", ins.attrs.get("lhs_contracting_dims", ""))]
  batch_d = [int(x) for x in re.findall(r"\d+", ins.attrs.get("lhs_batch_dims", ""))]
  k = math.prod(lhs_dims[d] for d in contract) if lhs_dims else 1
  batch = math.prod(lhs_dims[d] for d in batch_d) if lhs_dims else 1
  m = math.prod(s for i, s in enumerate(lhs_dims) if i not in contract and i not in batch_d) if lhs_dims else 1
  n = max(1, out.elements // max(1, batch * m))
  return 2.0 * out.elements * k, DotInfo(m=m, n=n, k=k, batch=batch, dtype=out.dtype,
                                         in_dtype=lhs.shapes[0].dtype if lhs is not None and lhs.shapes else "")


def _window(text: str) -> list:
  """Per spatial dimension of a convolution's ``window={size=.. stride=.. pad=.. lhs_dilate=.. rhs_dilate=..}``:
  (size, stride, pad_lo, pad_hi, lhs_dilation, rhs_dilation)."""
  fields = dict(re.findall(r"(\w+)=([\d_x\-]+)", text or ""))
  size = [int(x) for x in fields.get("size", "").split("x") if x]
  def per(key, default):
    v = fields.get(key)
    return [default] * len(size) if v is None else v.split("x")
  pads = [tuple(int(y) for y in p.split("_")) for p in per("pad", "0_0")]
  return [(size[d], int(per("stride", 1)[d]), pads[d][0], pads[d][1], int(per("lhs_dilate", 1)[d]),
           int(per("rhs_dilate", 1)[d])) for d in range(len(size))]


def _valid_taps(in_size: int, out_size: int, size: int, stride: int, lo: int, lhs_dil: int, rhs_dil: int) -> int:
  """(output position, window tap) pairs of one spatial dimension whose input index is a real element (not
  padding, not a hole of the base dilation): what HloCostAnalysis counts."""
  o = np.arange(out_size)[:, None]
  pos = o * stride + np.arange(size)[None, :] * rhs_dil - lo
  return int(np.count_nonzero((pos >= 0) & (pos % lhs_dil == 0) & (pos // lhs_dil < in_size)))


def conv_info(ins: hp.Instruction, comp: hp.Computation) -> tuple:
  """(flops, DotInfo) of a convolution from its ``dim_labels`` and window: 2 x output batch x output features x
  kernel input features x the valid (output position, window tap) pairs of every spatial dimension. XLA:TPU
  emits its matmuls this way (a dot is a convolution without spatial dimensions)."""
  lhs, rhs = (comp.by_name.get(o) for o in ins.operands[:2])
  m = re.fullmatch(r"(\w+)_(\w+)->(\w+)", ins.attrs.get("dim_labels", ""))
  out = ins.shapes[0]
  if m is None or lhs is None or rhs is None or not lhs.shapes or not rhs.shapes:
    return 2.0 * out.elements, None
  ll, rl, ol = m.groups()
  ld, rd, od = lhs.shapes[0].dims, rhs.shapes[0].dims, out.dims
  taps = 1
  for d, (size, stride, lo, _, ldil, rdil) in enumerate(_window(ins.attrs.get("window", ""))):
    c = str(d)
    taps *= _valid_taps(ld[ll.index(c)], od[ol.index(c)], size, stride, lo, ldil, rdil)
  batch, feat, k_in = od[ol.index("b")], od[ol.index("f")], rd[rl.index("i")]
  flops = 2.0 * batch * feat * k_in * taps
  m_rows = max(1, out.elements // max(1, feat))
  return flops, DotInfo(m=m_rows, n=feat, k=max(1, int(round(flops / (2.0 * m_rows * feat)))), batch=1,
                        dtype=out.dtype, in_dtype=lhs.shapes[0].dtype)


def _dnums_flops(lhs: tuple, rhs: tuple, dn: dict) -> float:
  """2 x batch x m x n x k of a dot from its operand dims and (backend-config) dimension numbers."""
  lc = [int(x) for x in dn.get("lhs_contracting_dimensions", [])]
  lb = [int(x) for x in dn.get("lhs_batch_dimensions", [])]
  rc = [int(x) for x in dn.get("rhs_contracting_dimensions", [])]
  rb = [int(x) for x in dn.get("rhs_batch_dimensions", [])]
  n = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
  return 2.0 * math.prod(lhs) * n


SPLASH_PRODUCTS = (("_fwd", 2), ("_dq", 3), ("_dkv", 4))  # QK^T, PV | QK^T, dP, dQ | QK^T, dP, dV, dK


def tpu_kernel_flops(ins: hp.Instruction, shapes: list) -> float:
  """Splash attention's Pallas kernels (jax.experimental.pallas.ops.tpu.splash_attention): the first two float
  operands are q ([..., T, E], heads leading) and k ([..., S, E]); each product is 2 x q elements x S, over the
  blocks a causal mask leaves: (n + 1) / 2n of n x n blocks of ``block_q`` (kernel metadata) queries. Other
  Pallas kernels: 0 (priced by their bytes)."""
  where = ins.name + " " + ins.op_name
  products = next((k for tag, k in SPLASH_PRODUCTS if "splash" in where and tag in where), 0)
  floats = [a.dims for a in shapes if a is not None and a.dtype in ("bf16", "f16", "f32") and len(a.dims) >= 3]
  if not products or len(floats) < 2:
    return 0.0
  q, k = floats[0], floats[1]
  block = re.search(r"block_q\w*\\?\"?:\s*(\d+)", ins.line)
  n = max(1, q[-2] // int(block.group(1))) if block else 0
  causal = (n + 1) / (2.0 * n) if n else 0.5
  return 2.0 * products * math.prod(q) * k[-2] * causal


def custom_call_flops(target: str, ins: hp.Instruction, comp: hp.Computation) -> tuple:
  """(flops, DotInfo or None) of the library calls that do matrix work, from their operand shapes and backend
  config: cuBLAS gemms; cuDNN fused attention (forward: QK^T and PV over the score tensor, 2 x 2 x scores x
  head_dim; backward: 5 such products; a causal mask skips the masked half of the tiles); TPU Pallas kernels
  (:func:`tpu_kernel_flops`). Anything else does no counted work (0, None)."""
  ops = [comp.by_name.get(o) for o in ins.operands]
  shapes = [o.shapes[0] if o is not None and o.shapes else None for o in ops]
  dims = [a.dims if a is not None else () for a in shapes]
  dtype = ops[0].shapes[0].dtype if ops and ops[0] is not None and ops[0].shapes else "bf16"
  bc = ins.backend_config
  flops, kernel, seq = 0.0, "", 0  # a fused attention call: its kind and key/value length (priced by their curve)
  if target.startswith("__cublas") and len(dims) >= 2:
    flops = _dnums_flops(dims[0], dims[1], bc.get("gemm_backend_config", {}).get("dot_dimension_numbers", {}))
  elif target.startswith("__cudnn$fmha"):
    fb = bc.get("cudnn_fmha_backend_config", {})
    score_dims = [int(d) for d in fb.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    contract = [int(x) for x in fb.get("bmm1_dot_dimension_numbers", {}).get("lhs_contracting_dimensions", [])]
    head = math.prod(dims[0][d] for d in contract) if dims and contract else (dims[0][-1] if dims and dims[0] else 1)
    products = 5 if "Backward" in target else 2
    causal = "CAUSAL" in str(fb.get("mask_type", ""))
    flops = 2.0 * products * math.prod(score_dims) * head * (0.5 if causal else 1.0)
    kernel = ("attention_bwd" if "Backward" in target else "attention_fwd") + ("_causal" if causal else "")
    seq = score_dims[-1] if score_dims else 0
  elif target == "tpu_custom_call":
    flops = tpu_kernel_flops(ins, shapes)
  if not flops:
    return 0.0, None
  return flops, DotInfo(m=1, n=1, k=1, batch=1, dtype=ins.shapes[0].dtype if ins.shapes else dtype, in_dtype=dtype,
                        kernel=kernel, seq=seq)


def computation_flops(module: hp.Module, comp: hp.Computation) -> tuple:
  """(flops, transcendentals, first DotInfo or None) of everything inside a (fused) computation."""
  flops, trans, dot = 0.0, 0.0, None
  for ins in comp.instructions:
    op = ins.opcode
    if op == "dot":
      f, d = _dot_info(ins, comp)
      flops += f
      dot = dot or d
    elif op == "convolution":
      f, d = conv_info(ins, comp)
      flops += f
      dot = dot or d
    elif op in ("fusion", "call", "map"):
      for c in ins.called():
        if c in module.computations:
          f, t, d = computation_flops(module, module.computations[c])
          flops, trans, dot = flops + f, trans + t, dot or d
    elif op in ("reduce", "reduce-window"):
      src = comp.by_name.get(ins.operands[0])
      flops += src.shapes[0].elements if src is not None and src.shapes else ins.shapes[0].elements
    elif op in TRANSCENDENTAL:
      trans += ins.shapes[0].elements
    elif op not in NO_FLOP and ins.shapes and not hp.collective_kind(op):  # a fused transfer computes nothing
      flops += ins.shapes[0].elements
  return flops, trans, dot


def _operand_read_bytes(module, ins, comp) -> float:
  """Bytes a fusion reads: a parameter used only through dynamic-slice/slice reads the slice only;
  the in-place buffer of a root dynamic-update-slice is not read at all (either through bitcasts too)."""
  body = module.computations.get(ins.called()[0]) if ins.opcode == "fusion" and ins.called() else None
  total = 0.0
  for idx, opname in enumerate(ins.operands):
    src = comp.by_name.get(opname)
    params = [p for p in body.instructions
              if p.opcode == "parameter" and p.attrs.get("parameter_number") == str(idx)] if body else []
    users = _users_through_bitcasts(body, params[0].name) if params else []
    if users and all(u.opcode in ("dynamic-slice", "slice") and u.operands[0] == n for n, u in users):
      total += sum(u.out_bytes for _, u in users)
    elif not (users and all(u.opcode == "dynamic-update-slice" and u.operands[0] == n for n, u in users)):
      total += src.out_bytes if src is not None else 0.0
  return total


def _users_through_bitcasts(body, name: str) -> list:
  """(operand name, user) pairs of ``name`` in a fusion body, through bitcasts (which read nothing)."""
  out = []
  for u in body.instructions:
    if name in u.operands:
      out.extend(_users_through_bitcasts(body, u.name) if u.opcode == "bitcast" else [(name, u)])
  return out


def _write_bytes(module, ins) -> float:
  body = module.computations.get(ins.called()[0]) if ins.opcode == "fusion" and ins.called() else None
  if body is not None and body.root.opcode == "dynamic-update-slice":
    upd = body.by_name.get(body.root.operands[1])
    return upd.out_bytes if upd is not None else ins.out_bytes
  return ins.out_bytes


def _attribution(ins: hp.Instruction, module: hp.Module) -> Attribution:
  name = ins.op_name
  phase = "bwd" if "transpose(" in name else "fwd"
  if any(t in name for t in ("optax", "apply_updates", "/adam", "scale_by", "clip_by")):
    phase = "opt"
  layer = ""
  m = re.search(r"/(layers_\d+|layers|embed|lm_head|final_norm)(?=/|$)", name)
  if m:
    layer = m.group(1)
  op = name.rsplit("/", 1)[-1] if name else ins.opcode
  return Attribution(op_name=name, source=ins.source(module.stack_frames), phase=phase, layer=layer, op=op)


def _collective_info(ins: hp.Instruction, comp: hp.Computation, kind: str, n_devices: int,
                     is_async: bool) -> CollectiveInfo:
  text = ins.attrs.get("replica_groups") or ins.attrs.get("source_target_pairs") or ""
  groups = parse_groups(kind, text, n_devices)
  if kind == "collective-permute":
    size, n = 2, max(1, len(groups))
  else:
    size, n = len(groups[0]) if groups else n_devices, len(groups)
  in_bytes = sum(comp.by_name[o].out_bytes for o in ins.operands if o in comp.by_name)
  out_bytes = ins.out_bytes
  if is_async and ins.shapes:
    # '*-start' results are tuples (operands, outputs[, scratch]): the output is the second half.
    out_bytes = max(0.0, out_bytes - in_bytes)
  payload = {"all-gather": max(out_bytes, in_bytes), "reduce-scatter": in_bytes}.get(kind, in_bytes or out_bytes)
  cid = re.search(r"\d+", ins.attrs.get("channel_id", "")) if ins.attrs.get("channel_id") else None
  return CollectiveInfo(kind=kind, group_size=size, n_groups=n, bytes=float(payload), groups_text=text,
                        channel_id=int(cid.group(0)) if cid else -1, is_async=is_async, n_devices=n_devices)


def tpu_async_collective(m: hp.Module, ins: hp.Instruction) -> Optional[tuple]:
  """('start' | 'done', the collective instruction, its fused computation) of an XLA:TPU async collective fusion
  (TPU_ASYNC); None for any other fusion."""
  body = m.computations.get(ins.called()[0]) if ins.called() else None
  if body is None:
    return None
  root = body.root
  target = re.sub(r'"', "", root.attrs.get("custom_call_target", "")) if root.opcode == "custom-call" else ""
  if target not in TPU_ASYNC:
    return None
  inner = next((i for i in body.instructions if hp.collective_kind(i.opcode)), None)
  if inner is None:
    return None
  return ("start" if target == TPU_ASYNC[0] else "done"), inner, body


# ---------------------------------------------------------------- builder

class _Builder:
  def __init__(self, module: hp.Module, n_devices: int):
    self.module, self.n_devices = module, n_devices
    self.regions, self.next_id = {}, 0
    # node id -> id of the TPU async collective start whose transfer it carries: the start, and the fusions that
    # continue the transfer in steps between the start and its done (xla_tpu_enable_async_collective_fusion_multiple_steps)
    self.carries = {}

  def region(self, comp_name: str) -> str:
    if comp_name in self.regions:
      return comp_name
    comp = self.module.computations[comp_name]
    self.regions[comp_name] = Region(comp_name, [])  # reserve (recursion guard)
    nodes, produced = [], {}  # instruction name -> frozenset of node ids it depends on / is
    starts = {}
    for ins in comp.instructions:
      dep_ids = frozenset().union(*[produced.get(o, frozenset()) for o in ins.operands]) if ins.operands else frozenset()
      if ins.opcode in FREE_OPS:
        produced[ins.name] = dep_ids
        continue
      node = self.make_node(ins, comp, tuple(sorted(dep_ids)), starts)
      if node is None:
        produced[ins.name] = dep_ids
        continue
      nodes.append(node)
      produced[ins.name] = frozenset([node.id])
    self.regions[comp_name] = Region(comp_name, nodes)
    return comp_name

  def carry(self, deps: tuple) -> tuple:
    """The node about to be made continues the TPU transfer one of ``deps`` carries, if any: it carries it on, and
    runs while the transfer is in flight (the transfer's end is no input of it). Returns its deps."""
    carried = next((self.carries[d] for d in deps if d in self.carries), None)
    if carried is None:
      return deps
    self.carries[self.next_id] = carried
    return tuple(d for d in deps if d != carried)

  def new_id(self) -> int:
    self.next_id += 1
    return self.next_id - 1

  def make_node(self, ins, comp, deps, starts) -> Optional[Node]:
    m, op = self.module, ins.opcode
    if op in ASYNC_COPIES:
      return None
    attr = _attribution(ins, m)
    tpu_async = tpu_async_collective(m, ins) if op == "fusion" else None
    if tpu_async is not None:
      role, inner, body = tpu_async
      if role == "done":  # it reads the start's buffers, directly or through the fusions that continue it
        start = next((self.carries[d] for d in reversed(deps) if d in self.carries), -1)
        return Node(id=self.new_id(), name=ins.name, kind="wait", opcode=f"fusion:{TPU_ASYNC[1]}", deps=deps,
                    attribution=attr, start=start)
      kind = hp.collective_kind(inner.opcode)
      info = _collective_info(inner, body, kind, self.n_devices, is_async=True)
      info = dataclasses.replace(info, bytes=float({"all-gather": inner.out_bytes}.get(kind, info.bytes)))
      node = Node(id=self.new_id(), name=ins.name, kind="p2p" if kind == "collective-permute" else "collective",
                  opcode=f"fusion:{TPU_ASYNC[0]}", bytes=info.bytes, out_bytes=ins.out_bytes, deps=deps,
                  attribution=attr, collective=info, fingerprint=f"{kind}|{info.group_size}|{int(info.bytes)}")
      starts[ins.name] = node.id
      self.carries[node.id] = node.id
      return node
    role = hp.async_role(op)
    kind = hp.collective_kind(op)
    if op in ("async-start", "async-done") and ins.called():
      wrapped = m.computations.get(ins.called()[0])
      if wrapped is not None:
        kind = hp.collective_kind(wrapped.root.opcode) or kind
    if role == "done":
      start = starts.get(ins.operands[0]) if ins.operands else None
      return Node(id=self.new_id(), name=ins.name, kind="wait", opcode=op, deps=deps, attribution=attr,
                  start=start if start is not None else -1)
    if kind is not None or op in ("send", "recv"):
      kind = kind or "collective-permute"
      target = ins
      if op == "async-start" and ins.called():
        wrapped = m.computations[ins.called()[0]]
        target = wrapped.root
        comp = wrapped
      info = _collective_info(target, comp, kind, self.n_devices, is_async=role == "start")
      if kind == "collective-permute" and role != "start" and WINDOWED_BODY in comp.name:
        # XLA's windowed einsum (collective matmul) cuts a sharded matmul into chunks whose ring transfers run
        # while the previous chunk multiplies: the permute is on the comm stream, what reads it waits for it
        pairs = info.groups()
        forward = bool(pairs) and pairs[0][1] == pairs[0][0] + 1
        info = dataclasses.replace(info, is_async=True, ring=1 if forward else -1)
      node = Node(id=self.new_id(), name=ins.name, kind="p2p" if kind == "collective-permute" else "collective",
                  opcode=op, bytes=info.bytes, out_bytes=ins.out_bytes, deps=deps, attribution=attr, collective=info,
                  fingerprint=f"{kind}|{info.group_size}|{int(info.bytes)}")
      if role == "start":
        starts[ins.name] = node.id
      return node
    if op == "while":
      body = ins.attrs.get("body", "").lstrip("%")
      trips = hp.trip_count(m, ins)
      self.region(body)
      deps = self.carry(deps)  # a TPU collective may continue in the loop's steps, finished after it
      return Node(id=self.new_id(), name=ins.name, kind="loop", opcode=op, deps=deps, attribution=attr, body=body,
                  trip_count=trips if trips is not None else 1,
                  fingerprint="" if trips is not None else "unknown_trip_count")
    if op == "conditional":
      # Every branch becomes a region; which one runs is decided at run time, so pricing needs the branch
      # weights perfmodel/pipeline.py resolves (costliest branch when nothing better is known).
      branches = conditional_branches(m, ins)
      if branches:
        for c in branches:
          self.region(c)
        return Node(id=self.new_id(), name=ins.name, kind="loop", opcode=op, deps=deps, attribution=attr,
                    body=branches[0], trip_count=1, branches=tuple(branches))
    if op == "call":
      called = [c for c in ins.called() if c in m.computations]
      if called:
        self.region(called[0])
        return Node(id=self.new_id(), name=ins.name, kind="loop", opcode=op, deps=deps, attribution=attr,
                    body=called[0], trip_count=1)
    flops, trans, dot = 0.0, 0.0, None
    if op == "fusion" or op == "dot" or op == "convolution":
      if op == "fusion":
        flops, trans, dot = computation_flops(m, m.computations[ins.called()[0]])
      elif op == "dot":
        flops, dot = _dot_info(ins, comp)
      else:
        sub = hp.Computation("_", [ins])
        sub.by_name.update({o: comp.by_name[o] for o in ins.operands if o in comp.by_name})
        flops, trans, dot = computation_flops(m, sub)
      nbytes = _operand_read_bytes(m, ins, comp) + _write_bytes(m, ins)
    elif op == "custom-call":
      target = re.sub(r'"', "", ins.attrs.get("custom_call_target", ""))
      if target in NO_WORK_CALLS:
        return None
      nbytes = sum(comp.by_name[o].out_bytes for o in ins.operands if o in comp.by_name) + ins.out_bytes
      flops, dot = custom_call_flops(target, ins, comp)
      fkind = "dot" if dot is not None or any(t in target.lower() for t in ("gemm", "matmul", "onednn", "cublas")) \
          else "other"
      return Node(id=self.new_id(), name=ins.name, kind=fkind, opcode=f"custom-call:{target}", flops=flops,
                  bytes=nbytes, out_bytes=ins.out_bytes, deps=deps, attribution=attr, dot=dot,
                  fingerprint=f"cc|{target}")
    else:
      nbytes = sum(comp.by_name[o].out_bytes for o in ins.operands if o in comp.by_name) + ins.out_bytes
      if op in TRANSCENDENTAL:
        trans = ins.shapes[0].elements if ins.shapes else 0
      elif op not in NO_FLOP and ins.shapes:
        flops = ins.shapes[0].elements
    fkind = ins.attrs.get("kind", "")
    node_kind = "dot" if dot is not None else "fusion"
    opcode = f"{op}:{fkind}" if fkind else op
    shapes = ";".join(f"{s.dtype}{list(s.dims)}" for s in ins.shapes)
    minor = moves_minor(m, ins, comp)
    fp = f"{node_kind}|{opcode}|{shapes}|f{int(flops)}|t{int(trans)}|b{int(nbytes)}"
    if dot is not None:
      fp = f"dot|{dot.dtype}|b{dot.batch}m{dot.m}n{dot.n}k{dot.k}|extra_f{int(flops - 2 * dot.batch * dot.m * dot.n * dot.k)}"
    fp += FP_PLAIN if dot is not None and op == "dot" else ""
    fp += FP_MINOR if minor else ""
    if op == "fusion" and dot is None:
      fp += structure_tag(m.computations[ins.called()[0]])
    if op == "fusion" and any(hp.collective_kind(i.opcode) for i in m.computations[ins.called()[0]].instructions):
      deps = self.carry(deps)  # a step of an in-flight TPU collective fused with this compute
    return Node(id=self.new_id(), name=ins.name, kind=node_kind, opcode=opcode, flops=flops, transcendentals=trans,
                bytes=nbytes, out_bytes=ins.out_bytes, deps=deps, attribution=attr, dot=dot, fingerprint=fp,
                moves_minor=minor, indexing=dot is None and indexes(m, ins))


def build_graph(module: hp.Module, n_devices: Optional[int] = None, program_bytes: bool = True) -> ExecGraph:
  """HLO module (per-device program) -> ExecGraph; ``program_bytes``: mark every compute node with the bytes of its
  program (the working-set context the fitted backends price by; a roofline needs none)."""
  n = n_devices or max(module.num_partitions, module.num_replicas)
  b = _Builder(module, n)
  b.region(module.entry)
  g = ExecGraph(regions=b.regions, entry=module.entry, n_devices=n, module_name=module.name)
  if program_bytes:
    mark_program_bytes(g)
  return g


def from_hlo_text(text: str, n_devices: Optional[int] = None) -> ExecGraph:
  return build_graph(hp.parse_module(text), n_devices)
