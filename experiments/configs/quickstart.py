"""Quickstart: a 3.28M-parameter Llama trained on the Python standard library's source, bytes as tokens.

Command (the README's first command runs exactly this on 8 emulated CPU devices, data=2 x tensor=4):
  python -m experiments.run --config experiments/configs/quickstart.py --workdir /tmp/prismllm/quickstart
Reproduces: loss falling from ln(256) = 5.55 to < 2.5 nats/byte within the run (README, "Quickstart").
Variants: ':runlocal=True' shrinks everything for a smoke test (a few seconds).
"""
import ml_collections

from framework.config_file import lock, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "quickstart"
  c.model = dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=768,
                 max_seq_len=256, rope_theta=10000.0, tie_embeddings=False, remat="none", scan_layers=True,
                 dtype="float32", param_dtype="float32")
  c.data = dict(corpus="stdlib", seq_len=128, global_batch=16, seed=0)
  c.optim = dict(lr=3e-3, warmup_steps=20, weight_decay=0.1, grad_clip=1.0)
  c.mesh = dict(data=2, tensor=4, fsdp=1, sequence=1, pipeline=1, rules="default", form="jit")
  c.checkpoint = dict(every=100, keep=2, async_save=True)
  c.train = dict(steps=200, log_every=10, eval_every=100, eval_batches=4, sample_tokens=120,
                 sample_prompt="def ", sample_temperature=0.7, progress=True)
  if a.runlocal:
    c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128)
    c.data.update(seq_len=32, global_batch=8)
    c.train.update(steps=4, log_every=2, eval_every=0, sample_tokens=16)
    c.checkpoint.update(every=2)
  return lock(c)
