"""Analytic execution graph of a training step: same ExecGraph type, no compile.

The fallback where no program can be had (the per-rank trace failed) and the graph ``search`` prices hundreds
of layouts with. The graph mirrors what the compiled jit step contains, per device:
a loop over the layers (trip = n_layers / pipeline) holding the matmuls of forward, backward and
remat recompute, elementwise fusions priced by bytes, Megatron TP all-reduces (synchronous), FSDP
all-gathers / reduce-scatters (async, overlappable), sequence-parallel K/V all-gathers; then
the LM head + loss, the data-parallel gradient all-reduce and the optimizer update.

Replica groups are written in XLA's iota format for the mesh order (pipeline, data, fsdp, sequence,
tensor; tensor innermost), so the collective model maps them onto NVLink islands exactly as it does
for a compiled program. ``tests/perfmodel`` cross-checks FLOPs and collective bytes against the
compiled graph of small configs.
"""
from __future__ import annotations

import itertools

from framework.config import MESH_AXES, Config
from perfmodel.graph.nodes import Attribution, CollectiveInfo, DotInfo, ExecGraph, Node, Region

_B = {"float32": 4, "bfloat16": 2, "float16": 2}


def axis_groups_text(mesh_sizes: dict, axes: tuple) -> str:
  """Iota replica groups of the devices varying along `axes` (mesh order MESH_AXES)."""
  dims = [mesh_sizes[a] for a in MESH_AXES]
  n = 1
  for d in dims:
    n *= d
  sel = [i for i, a in enumerate(MESH_AXES) if a in axes]
  keep = [i for i in range(len(dims)) if i not in sel]
  g = 1
  for i in sel:
    g *= dims[i]
  perm = keep + sel
  if perm == list(range(len(dims))):
    return f"[{n // g},{g}]<=[{n}]"
  return f"[{n // g},{g}]<=[{','.join(map(str, dims))}]T({','.join(map(str, perm))})"


class _G:
  def __init__(self, n_devices):
    self.ids = itertools.count()
    self.n = n_devices

  def dot(self, nodes, name, layer, phase, b, m, n, k, dtype):
    nodes.append(Node(id=next(self.ids), name=name, kind="dot", opcode="dot", flops=2.0 * b * m * n * k,
                      bytes=(b * m * k + b * k * n + b * m * n) * _B.get(dtype, 4), out_bytes=b * m * n * _B.get(dtype, 4),
                      deps=(nodes[-1].id,) if nodes else (), dot=DotInfo(m=m, n=n, k=k, batch=b,
                                                                      dtype={"float32": "f32"}.get(dtype, "bf16")),
                      attribution=Attribution(op_name=f"analytic/{layer}/{name}", phase=phase, layer=layer, op=name),
                      fingerprint=f"dot|{dtype}|b{b}m{m}n{n}k{k}|extra_f0"))

  def fusion(self, nodes, name, layer, phase, nbytes, flops=0.0, trans=0.0):
    nodes.append(Node(id=next(self.ids), name=name, kind="fusion", opcode="fusion:analytic", flops=flops,
                      transcendentals=trans, bytes=nbytes, out_bytes=nbytes / 3,
                      deps=(nodes[-1].id,) if nodes else (),
                      attribution=Attribution(op_name=f"analytic/{layer}/{name}", phase=phase, layer=layer, op=name)))

  def coll(self, nodes, name, kind, nbytes, groups, size, layer, phase, is_async):
    if size <= 1:
      return
    info = CollectiveInfo(kind=kind, group_size=size, n_groups=self.n // size, bytes=float(nbytes),
                          groups_text=groups, is_async=is_async, n_devices=self.n)
    nid = next(self.ids)
    nodes.append(Node(id=nid, name=name, kind="collective", opcode=kind + ("-start" if is_async else ""),
                      bytes=nbytes, deps=(nodes[-1].id,) if nodes else (), collective=info,
                      attribution=Attribution(op_name=f"analytic/{layer}/{name}", phase=phase, layer=layer, op=kind),
                      fingerprint=f"{kind}|{size}|{int(nbytes)}"))
    return nid

  def wait(self, nodes, start_id, name):
    nodes.append(Node(id=next(self.ids), name=name, kind="wait", opcode="done", start=start_id,
                      deps=(nodes[-1].id,) if nodes else ()))


def build(cfg: Config, microbatch_tokens_div: int = 1) -> ExecGraph:
  """Per-device graph of one training step (or of one micro-batch when microbatch_tokens_div > 1)."""
  m, mesh, d = cfg.model, cfg.mesh, cfg.data
  sizes = mesh.sizes()
  N = 1
  for v in sizes.values():
    N *= v
  g = _G(N)
  ab, pb = _B.get(m.dtype, 4), _B.get(m.param_dtype, 4)
  tp, fs, dp, sp, pp = mesh.tensor, mesh.fsdp, mesh.data, mesh.sequence, mesh.pipeline
  B = d.global_batch // (dp * fs) // microbatch_tokens_div
  T = d.seq_len // sp
  S = d.seq_len
  tok = B * T
  D, H, K, E, F, V = m.d_model, m.n_heads // tp, m.n_kv_heads // tp, m.hd, m.ff // tp, m.vocab_size
  dt = m.dtype
  layer_params = (D * H * E + 2 * D * K * E + H * E * D + 3 * D * F) + 2 * D  # per device after TP
  tp_groups = axis_groups_text(sizes, ("tensor",))
  fsdp_axes = ("data", "fsdp") if mesh.rules == "zero3" else ("fsdp",)
  fs_size = fs * (dp if mesh.rules == "zero3" else 1)
  if mesh.rules == "replicated":
    fs_size = 1
  fsdp_groups = axis_groups_text(sizes, fsdp_axes)
  dp_axes = tuple(a for a in ("data", "fsdp") if a not in fsdp_axes or fs_size == 1)
  dp_size = 1
  for a in dp_axes:
    dp_size *= sizes[a]
  body = []
  L = "layers"

  def layer_fwd(phase):
    ag = g.coll(body, f"fsdp_allgather_{phase}", "all-gather", layer_params * pb, fsdp_groups, fs_size, L, phase, True)
    g.fusion(body, "attn_norm", L, phase, 3 * tok * D * ab, flops=4 * tok * D, trans=tok)
    if ag is not None:
      g.wait(body, ag, "fsdp_allgather_done")
    g.dot(body, "wq", L, phase, 1, tok, H * E, D, dt)
    g.dot(body, "wk", L, phase, 1, tok, K * E, D, dt)
    g.dot(body, "wv", L, phase, 1, tok, K * E, D, dt)
    g.fusion(body, "rope", L, phase, 3 * tok * (H + K) * E * ab, flops=6 * tok * (H + K) * E, trans=0)
    if sp > 1:
      g.coll(body, "sp_allgather_kv", "all-gather", 2 * B * S * K * E * ab, axis_groups_text(sizes, ("sequence",)), sp,
             L, phase, False)
    g.dot(body, "scores", L, phase, B * H, T, S, E, dt)
    g.fusion(body, "softmax", L, phase, 3 * B * H * T * S * 4, flops=5 * B * H * T * S, trans=B * H * T * S)
    g.dot(body, "pv", L, phase, B * H, T, E, S, dt)
    g.dot(body, "wo", L, phase, 1, tok, D, H * E, dt)
    g.coll(body, "tp_allreduce_attn", "all-reduce", tok * D * ab, tp_groups, tp, L, phase, False)
    g.fusion(body, "residual_norm", L, phase, 5 * tok * D * ab, flops=6 * tok * D, trans=tok)
    g.dot(body, "w_gate", L, phase, 1, tok, F, D, dt)
    g.dot(body, "w_up", L, phase, 1, tok, F, D, dt)
    g.fusion(body, "silu_mul", L, phase, 3 * tok * F * ab, flops=5 * tok * F, trans=tok * F)
    g.dot(body, "w_down", L, phase, 1, tok, D, F, dt)
    g.coll(body, "tp_allreduce_mlp", "all-reduce", tok * D * ab, tp_groups, tp, L, phase, False)
    g.fusion(body, "residual", L, phase, 3 * tok * D * ab, flops=tok * D)

  layer_fwd("fwd")
  fwd_nodes = list(body)
  body.clear()
  if m.remat != "none":
    layer_fwd("bwd")  # recompute (dots policy also recomputes, here approximated as a full recompute of fusions)
    if m.remat in ("dots", "dots_no_batch"):
      body[:] = [n for n in body if n.kind != "dot"]
  # Backward: each forward matmul becomes two (dgrad + wgrad); fusions roughly double their bytes.
  for n in fwd_nodes:
    if n.kind == "dot":
      dd = n.dot
      g.dot(body, n.name + "_dgrad", L, "bwd", dd.batch, dd.m, dd.k, dd.n, dt)
      g.dot(body, n.name + "_wgrad", L, "bwd", dd.batch, dd.k, dd.n, dd.m, dt)
    elif n.kind == "fusion":
      g.fusion(body, n.name + "_bwd", L, "bwd", 2 * n.bytes, flops=2 * n.flops, trans=n.transcendentals)
    elif n.kind == "collective" and n.collective.kind == "all-reduce":
      g.coll(body, n.name + "_bwd", "all-reduce", n.collective.bytes, tp_groups, tp, L, "bwd", False)
  rs = g.coll(body, "fsdp_reducescatter_grads", "reduce-scatter", layer_params * pb, fsdp_groups, fs_size, L, "bwd",
              True)
  if rs is not None:
    g.wait(body, rs, "fsdp_reducescatter_done")
  body_nodes = fwd_nodes + body
  loop = Node(id=next(g.ids), name="layers_loop", kind="loop", opcode="while", body="layers_body",
              trip_count=m.n_layers // pp, attribution=Attribution(op_name="analytic/layers", layer=L))
  entry = []
  g.fusion(entry, "embed_gather", "embed", "fwd", 2 * tok * D * ab)
  entry.append(loop)
  g.fusion(entry, "final_norm", "final_norm", "fwd", 3 * tok * D * ab, flops=4 * tok * D, trans=tok)
  g.dot(entry, "lm_head", "lm_head", "fwd", 1, tok, V // tp, D, dt)
  g.fusion(entry, "loss", "lm_head", "fwd", 4 * tok * (V // tp) * 4, flops=5 * tok * V // tp, trans=tok * V // tp)
  g.dot(entry, "lm_head_dgrad", "lm_head", "bwd", 1, tok, D, V // tp, dt)
  g.dot(entry, "lm_head_wgrad", "lm_head", "bwd", 1, D, V // tp, tok, dt)
  g.coll(entry, "tp_allreduce_head", "all-reduce", tok * D * ab, tp_groups, tp, "lm_head", "bwd", False)
  n_dev_params = (layer_params * m.n_layers // pp + 2 * D * V // tp) / max(1, fs_size)
  if dp_size > 1:
    g.coll(entry, "dp_allreduce_grads", "all-reduce", n_dev_params * pb, axis_groups_text(sizes, dp_axes), dp_size,
           "", "bwd", False)
  # AdamW: read param, grad, 2 moments; write param, 2 moments.
  g.fusion(entry, "optimizer", "", "opt", 7 * n_dev_params * pb, flops=12 * n_dev_params, trans=n_dev_params)
  regions = {"entry": Region("entry", entry), "layers_body": Region("layers_body", body_nodes)}
  return ExecGraph(regions=regions, entry="entry", n_devices=N, module_name=f"analytic:{cfg.name}")
