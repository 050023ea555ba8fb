"""Llama-70B-class config at 8192 devices (data 16 x FSDP 64 x tensor 8) for the performance model.

Commands:
  # predicted step time, tokens/s, MFU and memory on H100s (python -m perfmodel predict --help: routes)
  python -m perfmodel predict --config experiments/configs/perfmodel_llama70b.py --hardware h100
  # layouts of the same model on 8192 devices under the H100's memory limit
  python -m perfmodel search --config experiments/configs/perfmodel_llama70b.py --hardware h100 --devices 8192 --top 5
Variants: ':runlocal=True' keeps the axes and the Llama shape family at toy size (2 layers, d=128) on
data=2 x fsdp=2 x tensor=2 = 8 devices: a CPU smoke test of the same code path (seconds).
"""
import ml_collections

from framework.config_file import parse_arg


def get_config(arg=None):
  a = parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "llama70b"
  c.model = dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, max_seq_len=4096,
                 dtype="bfloat16", param_dtype="float32", remat="full")
  c.data = dict(seq_len=4096, global_batch=1024)
  c.mesh = dict(data=16, fsdp=64, tensor=8)
  if a.runlocal:
    c.name = "llama70b_local"
    c.model.update(vocab_size=256, d_model=128, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=448, max_seq_len=64,
                   dtype="float32")
    c.data.update(seq_len=64, global_batch=8)
    c.mesh.update(data=2, fsdp=2, tensor=2)
  c = ml_collections.ConfigDict(c.to_dict())
  c.lock()
  return c
