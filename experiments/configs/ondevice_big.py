"""On-device benchmark model "big": 16 layers, d=1024, 16/4 heads, FFN 2816, byte vocab (~203M parameters),
random weights: large enough that decoding is memory-bound, as on a real device.

Command (export once, then bench; --record makes the bench write the committed
benchmarks/data/ondevice_bench_single.json):
  python -m ondevice.export --random --config experiments/configs/ondevice_big.py --out /tmp/big-q4_0.gguf --quant q4_0
  python -m ondevice.bench --model /tmp/big-q4_0.gguf --suite single
Variant ':layers=N' changes the depth, e.g. ':layers=4' (~46M parameters) for a quicker bench. The model-size
sweep of benchmarks/ondevice_latency.png uses models of its own (the 'small' shape of ondevice_tiny.py), not this config.
"""
import ml_collections

from framework.config_file import parse_arg


def get_config(arg=None):
  a = parse_arg(arg, layers=16, init_std=0.02)
  c = ml_collections.ConfigDict()
  c.name = f"ondevice_big_L{a.layers}"
  c.model = dict(vocab_size=256, d_model=1024, n_layers=a.layers, n_heads=16, n_kv_heads=4, d_ff=2816,
                 max_seq_len=1024, rope_theta=10000.0, tie_embeddings=False, scan_layers=True,
                 dtype="float32", param_dtype="float32", init_std=a.init_std)
  c = ml_collections.ConfigDict(c.to_dict())
  c.lock()
  return c
