"""Llama-3-70B pre-training step at 8192 ranks: tensor=8 x pipeline=16 x fsdp=64 (ZeRO-3).

Model: Llama 3 70B (Dubey et al. 2024, Table 3): 80 layers, d_model 8192, d_ff 28672, 64 query heads,
8 KV heads (GQA), head_dim 128, vocab 128256, RoPE theta 500000, untied head. bf16 compute with
float32 master weights and AdamW moments; full rematerialisation per layer. Sequence 8192, global
batch 1024 sequences (8.4M tokens; 16 per data-parallel replica, 16 pipeline micro-batches of one
sequence, 1F1B). The 4D layout follows the Llama 3 paper's TP8 x PP16 x FSDP scheme.

Commands:
  # emulate 8192 ranks from one CPU device (compile-only slicing + memory: about 2 minutes on 2 cores)
  python -m perfmodel.emulate --config experiments/configs/llama3_70b.py --hardware h100 --compile-only --out /tmp/l70b
  # smoke-train the same code path at toy size on 8 emulated CPU devices
  python -m experiments.run --config experiments/configs/llama3_70b.py:runlocal=True --workdir /tmp/l70b_local
Reproduces: benchmarks/data/emulate_l70b.json (its row in benchmarks/RESULTS.md): the scale benchmark wraps the
first command and `perfmodel predict`, and writes the committed benchmarks/data/emulate_l70b.json:
  python -m benchmarks.emulate_scale --hardware h100
"""
import ml_collections

from framework.config_file import lock, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "llama3_70b"
  c.model = dict(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128, d_ff=28672,
                 max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False, remat="full",
                 scan_layers=True, dtype="bfloat16", param_dtype="float32")
  c.data = dict(corpus="stdlib", seq_len=8192, global_batch=1024, seed=0)
  c.optim = dict(lr=1.5e-4, warmup_steps=2000, min_lr_ratio=0.01, b1=0.9, b2=0.95, weight_decay=0.1, grad_clip=1.0)
  c.mesh = dict(data=1, tensor=8, fsdp=64, sequence=1, pipeline=16, rules="default", form="shard_map",
                microbatches=16, schedule="1f1b")
  c.checkpoint = dict(every=500, keep=2, async_save=True)
  c.train = dict(steps=100000, log_every=10, eval_every=0, sample_tokens=0, progress=True)
  if a.runlocal:
    c.model.update(vocab_size=256, d_model=64, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=8, d_ff=192,
                   max_seq_len=64, dtype="float32")
    c.data.update(seq_len=32, global_batch=8)
    c.mesh.update(data=1, fsdp=2, tensor=2, pipeline=2, microbatches=2)
    c.train.update(steps=4, log_every=2)
    c.checkpoint.update(every=0)
  return lock(c)
