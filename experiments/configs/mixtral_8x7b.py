"""Mixtral 8x7B pre-training step with expert parallelism: fsdp=32 x expert=8 (256 devices).

Model: Mixtral 8x7B (Jiang et al. 2024; the Hugging Face config): 32 layers, d_model 4096, 32 query / 8 KV heads
of 128, 8 experts of width 14336 per layer, top-2 softmax routing renormalised over the two, vocab 32000, RoPE
theta 1e6, untied head; 46.7B parameters, 12.9B active per token. bf16 compute with float32 parameters and
AdamW moments; full rematerialisation. Load-balancing weight 0.01 (MaxText's default; the paper does not give
one). Sequence 4096, global batch 512 sequences. The layout is a choice, not a published run's.

Commands:
  # predict the step on H100s from the program compiled for them (no GPU needed)
  python -m perfmodel predict --config experiments/configs/mixtral_8x7b.py --hardware h100
  # smoke-train the same code path at toy size on 8 emulated CPU devices
  python -m experiments.run --config experiments/configs/mixtral_8x7b.py:runlocal=True --workdir /tmp/mixtral_local
"""
import ml_collections

from framework.config_file import lock, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "mixtral_8x7b"
  c.model = dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                 max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5, tie_embeddings=False, remat="full",
                 n_experts=8, experts_per_token=2, moe_d_ff=14336, router="softmax", moe_norm_topk=True,
                 moe_impl="dropless", aux_loss_coef=0.01, dtype="bfloat16", param_dtype="float32")
  c.data = dict(corpus="stdlib", seq_len=4096, global_batch=512, seed=0)
  c.optim = dict(lr=1e-4, warmup_steps=2000, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0)
  c.mesh = dict(fsdp=32, expert=8, form="shard_map")
  c.checkpoint = dict(every=500, keep=2, async_save=True)
  c.train = dict(steps=100000, log_every=10, eval_every=0, sample_tokens=0, progress=True)
  if a.runlocal:
    c.model.update(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, moe_d_ff=96,
                   max_seq_len=64, remat="none", dtype="float32")
    c.data.update(seq_len=32, global_batch=8)
    c.mesh.update(fsdp=2, expert=4)
    c.train.update(steps=4, log_every=2)
    c.checkpoint.update(every=0)
  return lock(c)
