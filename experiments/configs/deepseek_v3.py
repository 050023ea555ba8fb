"""DeepSeek-V3 pre-training step, stand-in attention: data=32 x expert=64 (2048 devices).

Model: DeepSeek-V3 (DeepSeek-AI 2024, section 4.2): 61 layers, d_model 7168, 256 routed experts of width 2048 and
one shared expert per layer, top-8 of per-expert sigmoid scores renormalised, routed output scaled by 2.5,
vocab 129280; 671B parameters, 37B active. Stand-ins, said plainly: (1) attention is multi-head attention with
128 heads of 128 (MHA) in place of Multi-head Latent Attention (MLA compresses K/V to a 512-wide latent and uses
192-wide q/k heads: fewer KV bytes, a few more FLOPs); (2) every layer is MoE (the first 3 of V3's are dense);
(3) no multi-token prediction module; (4) the auxiliary-loss-free bias balancing is not modelled, only the
sequence-wise balance loss (weight 1e-4, as the paper's). bf16 compute (the paper trains in fp8), float32
parameters and moments, full rematerialisation. Sequence 4096, global batch 2048 sequences (8.4M tokens; the
paper ramps its batch from 3072 to 15360 sequences). DeepSeek ran PP16 x EP64 x ZeRO-1 DP on 2048 H800; this
layout (EP64 x DP32, no pipeline: 61 layers do not split into 16 equal stages) is a choice.

Commands:
  python -m perfmodel predict --config experiments/configs/deepseek_v3.py --hardware h100
  python -m experiments.run --config experiments/configs/deepseek_v3.py:runlocal=True --workdir /tmp/dsv3_local
"""
import ml_collections

from framework.config_file import lock, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "deepseek_v3"
  c.model = dict(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=128,
                 max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False, remat="full",
                 n_experts=256, experts_per_token=8, moe_d_ff=2048, n_shared_experts=1, router="sigmoid",
                 moe_norm_topk=True, router_scale=2.5, moe_impl="dropless", aux_loss_coef=1e-4,
                 dtype="bfloat16", param_dtype="float32")
  c.data = dict(corpus="stdlib", seq_len=4096, global_batch=2048, seed=0)
  c.optim = dict(lr=2.2e-4, warmup_steps=2000, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0)
  c.mesh = dict(data=32, expert=64, form="shard_map")
  c.checkpoint = dict(every=500, keep=2, async_save=True)
  c.train = dict(steps=100000, log_every=10, eval_every=0, sample_tokens=0, progress=True)
  if a.runlocal:
    c.model.update(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, n_experts=16,
                   experts_per_token=4, moe_d_ff=32, max_seq_len=64, remat="none", dtype="float32")
    c.data.update(seq_len=32, global_batch=8)
    c.mesh.update(data=2, expert=4)
    c.train.update(steps=4, log_every=2)
    c.checkpoint.update(every=0)
  return lock(c)
