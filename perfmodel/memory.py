"""Per-device peak memory: the compiled program's own accounting, plus an analytic breakdown.

``compiled.memory_analysis()`` is the truth for the compiler that produced it (on CPU its 'peak'
ignores temporaries, so peak = argument + output - alias + temp, see program.memory_of). The analytic
breakdown (parameters, optimizer state, gradients, activations under the remat policy, logits) needs
no compile and serves ``search`` at scales where compiling every candidate is too slow; tests
report how far it is from memory_analysis.
"""
from __future__ import annotations

import dataclasses

from framework.config import Config

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
  params: float
  opt_state: float
  grads: float
  activations: float
  logits: float

  @property
  def total(self) -> float:
    return self.params + self.opt_state + self.grads + self.activations + self.logits

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), "total": self.total}


def analytic(cfg: Config) -> MemoryBreakdown:
  m, mesh, d = cfg.model, cfg.mesh, cfg.data
  pb, ab = _BYTES.get(m.param_dtype, 4), _BYTES.get(m.dtype, 4)
  shard = mesh.fsdp * mesh.tensor * mesh.pipeline  # matrices shard over FSDP (embed) x TP (heads/mlp)
  if mesh.rules == "zero3":
    shard *= mesh.data
  elif mesh.rules == "replicated":
    shard = mesh.tensor * mesh.pipeline
  n_layer_params = m.n_params(embeddings=False) - (0 if m.tie_embeddings else m.vocab_size * m.d_model)
  emb = m.vocab_size * m.d_model  # gather table: replicated over tensor, sharded over fsdp
  head = 0 if m.tie_embeddings else m.vocab_size * m.d_model
  params = (n_layer_params + head) * pb / shard + emb * pb / max(1, shard // mesh.tensor)
  opt = 2 * params  # Adam moments in the parameter dtype
  grads = params
  tokens = d.global_batch * d.seq_len / (mesh.data * mesh.fsdp * mesh.sequence)
  if mesh.pipeline == 1:
    tokens /= mesh.microbatches  # gradient accumulation: one micro-batch's activations at a time
  D, H, K, E, F, T = m.d_model, m.n_heads, m.n_kv_heads, m.hd, m.ff, d.seq_len
  tp = mesh.tensor
  # Width per token of the residual stream and norms on one device: 1/tp of it under sequence parallelism
  # (mesh.tensor_sequence_parallel), where remat=none still keeps the two all-gathered matmul inputs whole.
  sp = (mesh.tensor_sequence_parallel or mesh.rules == "maxtext") and tp > 1
  Dr = D / tp if sp else D
  # Values saved for the backward pass per token per layer (elements), by remat policy.
  full = (4 * Dr + 2 * D if sp else 6 * D) + ((H + 2 * K) * E + H * E) / tp + 4 * F / tp + 2 * H * T / tp
  dots = ((H + 2 * K) * E + H * E) / tp + 2 * H * T / tp + 2 * F / tp + Dr
  # MaxText's named policies keep the layer input plus their named outputs (offloaded ones: the input only)
  qkv, mlp_in = (H + 2 * K) * E / tp, (m.mlp_matrices - 1) * F / tp
  saved = {"none": full, "dots": dots, "dots_no_batch": dots, "full": Dr, "minimal": 3 * Dr + qkv + mlp_in,
           "minimal_flash": 3 * Dr + qkv + mlp_in + H * E / tp,
           "save_qkv_proj": Dr + qkv, "save_dot_except_mlp": 2 * Dr + qkv, "save_out_proj": 2 * Dr}.get(m.remat, Dr)
  layers_here = m.n_layers / mesh.pipeline
  act = tokens * ab * (saved * layers_here + (full if m.remat != "none" else 0))
  logits = tokens * m.vocab_size / tp * 4 * 3  # f32 logits, softmax and its gradient
  return MemoryBreakdown(params=params, opt_state=opt, grads=grads, activations=act, logits=logits)
