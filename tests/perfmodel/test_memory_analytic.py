"""The analytic memory breakdown (perfmodel/memory.py) under sequence parallelism of the tensor axis."""
import dataclasses

from framework.config import Config, DataConfig, MeshConfig, ModelConfig
from perfmodel import memory


def _act(remat: str, sp: bool) -> float:
  cfg = Config(model=ModelConfig(d_model=1024, n_heads=16, n_kv_heads=16, n_layers=4, remat=remat, max_seq_len=2048),
               data=DataConfig(seq_len=2048, global_batch=8),
               mesh=MeshConfig(tensor=4, data=2, form="shard_map", tensor_sequence_parallel=sp))
  return memory.analytic(cfg).activations


def test_sequence_parallel_divides_the_residual_stream_by_tensor():
  # remat=full keeps each layer's input (D -> D/4 per token) plus one layer's working set while it is recomputed
  # (its 6 D-wide values -> 4 chunks + the 2 gathered matmul inputs): tokens per device 8 x 2048 / 2, float32
  tokens, d, tp, layers = 8 * 2048 // 2, 1024, 4, 4
  want = tokens * 4 * ((d - d / tp) * layers + (6 * d - (4 * d / tp + 2 * d)))
  assert _act("full", False) - _act("full", True) == want
  for remat in ("minimal", "none", "save_out_proj"):
    assert _act(remat, True) < _act(remat, False), remat
  # tensor = 1: a no-op
  cfg = Config(mesh=MeshConfig(tensor=1, data=8, form="shard_map", tensor_sequence_parallel=True))
  assert memory.analytic(cfg) == memory.analytic(dataclasses.replace(cfg, mesh=MeshConfig(data=8)))
