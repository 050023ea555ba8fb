"""Sharding rules as data: logical axis name -> mesh axes.

A preset is a tuple of ``(logical_axis, mesh_axes)``. Mesh axes of size 1 make a rule a no-op, so
one preset serves every layout; presets differ in *what* gets sharded, not in the mesh.
"""
from __future__ import annotations

from framework.config import ConfigError

_ACTIVATIONS = (
    ("batch", ("data", "fsdp", "expert")),
    ("seq", "sequence"),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)

def _params(embed) -> tuple:
  """Parameter rules; presets differ only in where the 'embed' dim of matrices is sharded."""
  return (
      ("embed", embed),
      ("embed_vocab", "tensor"),  # Megatron's VocabParallelEmbedding, MaxText's 'vocab' rule
      ("vocab", "tensor"),
      ("q_heads", "tensor"),
      ("kv_heads", "tensor"),
      ("head_dim", None),
      ("mlp", "tensor"),
      ("norm", None),
      ("layers", "pipeline"),
      ("experts", "expert"),  # mixture of experts: the expert dim over the expert axis
      ("expert_mlp", "tensor"),  # each expert's width, column / row parallel like the MLP's
      ("router", None),
  )


PRESETS = {
    # FSDP shards the 'embed' dim of every matrix; Megatron TP shards heads / mlp / vocab (head and embedding);
    # the pipeline axis shards the layer stack (used by the shard_map pipeline).
    "default": _ACTIVATIONS + _params("fsdp"),
    # ZeRO-3 over every batch axis: parameters sharded over data x fsdp.
    "zero3": _ACTIVATIONS + _params(("data", "fsdp")),
    # FSDP over the fsdp and context-parallel ranks together (torchtitan's 'dp_shard_cp' mesh; MaxText's
    # 'embed' rule lists the context axis too): every parameter, gradient and optimizer state 1/(fsdp x sequence).
    "fsdp_sequence": _ACTIVATIONS + _params(("fsdp", "sequence")),
    # Everything replicated except tensor parallelism (plain DDP + TP).
    "replicated": _ACTIVATIONS + _params(None),
    # MaxText's logical_axis_rules: the default parameters, and the residual stream between blocks sharded along
    # its embed dim over the tensor axis ('activation_embed': 'tensor'), so the partitioner gathers it before each
    # block's first matmul and reduce-scatters after the last (jit form only).
    "maxtext": tuple((k, "tensor" if k == "act_embed" else v) for k, v in _ACTIVATIONS) + _params("fsdp"),
}


def get(name: str) -> tuple:
  if name not in PRESETS:
    raise ConfigError(f"mesh.rules={name!r} is not a preset; choose one of {sorted(PRESETS)}")
  return PRESETS[name]


def without(rules: tuple, *mesh_axes: str) -> tuple:
  """Rules with the given mesh axes removed (e.g. 'pipeline' for the non-pipelined jit form)."""
  out = []
  for logical, axes in rules:
    if axes is None:
      out.append((logical, None))
      continue
    axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
    kept = tuple(a for a in axes_t if a not in mesh_axes)
    out.append((logical, kept[0] if len(kept) == 1 else (kept or None)))
  return tuple(out)
