"""Hot-swap resilience (PHOENIX / DeadPool-style): 4 nodes + 1 warm spare on localhost, FSDP over the nodes,
replicated in-memory snapshots every step, failures injected from the config.

Command:
  python -m experiments.run --config experiments/configs/hotswap.py --workdir /tmp/prismllm/hotswap \
      --config.extras.resilience.fail_at=12 --config.extras.resilience.fail_kind=node
Reproduces: the run survives the injected failure, the spare takes the failed rank, and losses and final
state are bit-identical to a failure-free run (`python -m benchmarks.hotswap` measures it side by side). The persistent
tier (async orbax every 10 steps) is on: rerun the same command after the controller died and it resumes.
Variants: ':runlocal=True' is the small model used by tests/resilience (seconds per run).
Model: ~3.3M params = 13.1 MB fp32 (39 MB train state with AdamW moments, 9.9 MB per node).
"""
import ml_collections

from framework.config_file import parse_arg


def get_config(arg=None):
  a = parse_arg(arg, runlocal=False, nodes=4, spares=1, replicas=1)
  c = ml_collections.ConfigDict()
  c.name = "hotswap"
  c.model = dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=768, max_seq_len=128,
                 remat="none", scan_layers=True, dtype="float32", param_dtype="float32")
  c.data = dict(corpus="stdlib", max_bytes=2_000_000, seq_len=64, global_batch=8, seed=0)
  c.optim = dict(lr=3e-3, warmup_steps=10, weight_decay=0.1, grad_clip=1.0)
  # one CPU device per node process: FSDP shards parameters and moments across the nodes, so a node's
  # snapshot is only its shard and losing it without a replica really loses state
  c.mesh = dict(data=1, fsdp=-1, tensor=1, sequence=1, pipeline=1, rules="default", form="jit")
  c.checkpoint = dict(every=0, keep=2, async_save=True)
  c.train = dict(steps=40, log_every=10, eval_every=0, sample_tokens=0, progress=False)
  c.extras = dict(resilience=dict(
      nodes=a.nodes, spares=a.spares, replicas=a.replicas, respawn_spares=False,
      fail_at="", fail_kind="worker", fail_rank=-1, fail_seed=0,
      heartbeat_s=0.25, heartbeat_timeout_s=2.0, persist_every=10, overhead_probe_block=0, compile_cache_dir=""))
  if a.runlocal:
    c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32)
    c.data.update(seq_len=32, global_batch=8, max_bytes=200_000)
    c.train.update(steps=12)
  c = ml_collections.ConfigDict(c.to_dict())
  c.lock()
  return c
