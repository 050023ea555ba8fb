"""Llama-70B-class config for perfmodel tests (8192 devices)."""
import ml_collections
def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.name = "llama70b"
  c.model = dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, max_seq_len=4096,
                 dtype="bfloat16", param_dtype="float32", remat="full")
  c.data = dict(seq_len=4096, global_batch=1024)
  c.mesh = dict(data=16, fsdp=64, tensor=8)
  c.lock()
  return c
