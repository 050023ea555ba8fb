"""MoE quickstart: a mixture-of-experts Llama (8 experts, top-2, one shared expert) trained on the Python standard
library's source, bytes as tokens, with expert parallelism.

Command (8 emulated CPU devices, data=2 x expert=4 in the shard_map form: each MoE layer exchanges tokens with two
all_to_all over the expert axis):
  python -m experiments.run --config experiments/configs/moe_quickstart.py --workdir /tmp/prismllm/moe_quickstart
Reproduces: loss falling from ln(256) = 5.55 nats/byte; tests/experiments/test_moe_quickstart.py runs the
':runlocal=True' variant (60 steps) and checks that its loss falls, in about a minute on 2 cores.
The router's assignments per layer and expert are in the step's metrics (StepMetrics.expert_load).
"""
import ml_collections

from framework.config_file import lock, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, runlocal=False)
  c = ml_collections.ConfigDict()
  c.name = "moe_quickstart"
  c.model = dict(vocab_size=256, d_model=128, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256,
                 n_experts=8, experts_per_token=2, moe_d_ff=256, n_shared_experts=1, router="softmax",
                 moe_impl="dropless", aux_loss_coef=0.01, dtype="float32", param_dtype="float32")
  c.data = dict(corpus="stdlib", seq_len=128, global_batch=16, seed=0)
  c.optim = dict(lr=3e-3, warmup_steps=20, weight_decay=0.1, grad_clip=1.0)
  c.mesh = dict(data=2, expert=4, form="shard_map")
  c.checkpoint = dict(every=100, keep=2, async_save=True)
  c.train = dict(steps=200, log_every=10, eval_every=100, eval_batches=4, sample_tokens=120,
                 sample_prompt="def ", sample_temperature=0.7, progress=True)
  if a.runlocal:
    c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, moe_d_ff=64)
    c.data.update(seq_len=64, global_batch=8)
    c.optim.update(warmup_steps=5)
    c.train.update(steps=60, log_every=10, eval_every=0, sample_tokens=16)
    c.checkpoint.update(every=0)
  return lock(c)
