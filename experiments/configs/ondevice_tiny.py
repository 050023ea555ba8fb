"""On-device smoke model: 4 layers, d=64, byte vocab (tests and quick demos; random weights).

Commands:
  python -m ondevice.export --random --config experiments/configs/ondevice_tiny.py --out /tmp/tiny.gguf --quant q8_0
  python -m ondevice.run --model /tmp/tiny.gguf --prompt "def " --max-tokens 32 --greedy
Variant ':size=small' = 8 layers, d=256 (a few MB; emulated-ring demos in seconds).
"""
import ml_collections

from framework.config_file import parse_arg

SIZES = {
    "tiny": dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=192),
    "small": dict(d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=768),
}


def get_config(arg=None):
  a = parse_arg(arg, size="tiny", init_std=0.02)
  c = ml_collections.ConfigDict()
  c.name = f"ondevice_{a.size}"
  c.model = dict(vocab_size=256, max_seq_len=512, rope_theta=10000.0, tie_embeddings=False, scan_layers=True,
                 dtype="float32", param_dtype="float32", init_std=a.init_std, **SIZES[a.size])
  c = ml_collections.ConfigDict(c.to_dict())
  c.lock()
  return c
