"""Qwen3-30B-A3B pre-training step (the model Charon evaluates): data=8 x expert=16 x tensor=1 (128 devices).

Model: Qwen3-30B-A3B (the Hugging Face config): 48 layers, d_model 2048, 32 query / 4 KV heads of 128, 128
experts of width 768 per layer, top-8 softmax routing renormalised over the eight (``norm_topk_prob``), vocab
151936, RoPE theta 1e6, untied head; 30.5B parameters, 3.3B active. Stand-in: Qwen3's per-head q/k RMSNorm is
not modelled (2 x 128 weights per layer; it changes no matmul). Load-balancing weight 0.001 (the config's
``router_aux_loss_coef``). bf16 compute, float32 parameters and moments, full rematerialisation. Sequence 4096,
global batch 256. The layout is a choice, not a published run's.

Commands:
  python -m perfmodel predict --config experiments/configs/qwen3_30b_a3b.py --hardware h100
  python -m experiments.run --config experiments/configs/qwen3_30b_a3b.py:runlocal=True --workdir /tmp/qwen3moe_local
"""
import ml_collections

from framework.config_file import lock, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "qwen3_30b_a3b"
  c.model = dict(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                 max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=False, remat="full",
                 n_experts=128, experts_per_token=8, moe_d_ff=768, router="softmax", moe_norm_topk=True,
                 moe_impl="dropless", aux_loss_coef=0.001, dtype="bfloat16", param_dtype="float32")
  c.data = dict(corpus="stdlib", seq_len=4096, global_batch=256, seed=0)
  c.optim = dict(lr=3e-4, warmup_steps=2000, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0)
  c.mesh = dict(data=8, expert=16, form="shard_map")
  c.checkpoint = dict(every=500, keep=2, async_save=True)
  c.train = dict(steps=100000, log_every=10, eval_every=0, sample_tokens=0, progress=True)
  if a.runlocal:
    c.model.update(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=16,
                   experts_per_token=4, moe_d_ff=32, max_seq_len=64, remat="none", dtype="float32")
    c.data.update(seq_len=32, global_batch=8)
    c.mesh.update(data=2, expert=4)
    c.train.update(steps=4, log_every=2)
    c.checkpoint.update(every=0)
  return lock(c)
