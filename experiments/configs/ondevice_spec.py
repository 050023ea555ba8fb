"""Speculative-decoding pair for ondevice benchmarks, trained on the stdlib corpus (bytes as tokens).

role=target: 8 layers, d=128, 4/2 heads, FFN 384 (1.6M params).
role=draft:  2 layers, d=64, 4/2 heads, FFN 192 (0.1M params), same byte vocabulary.
One host device (no mesh), batch 8 x 64 bytes; :steps=N (default 200, a smoke run; the benchmarks in
ondevice/README.md use 8000, ~40 min each on a loaded 2-core CPU). Both models stay weak (a byte-level model
this small on CPU-minutes of training): report acceptance, never assume it.

Commands (train both, export, benchmark; prompts are cut from the stdlib source the pair is trained on; --record
makes a bench write the committed benchmarks/data/ondevice_bench_<suite>.json):
  python -m experiments.run --config experiments/configs/ondevice_spec.py:role=target,steps=8000 --host-devices 1 --workdir /tmp/od_target
  python -m experiments.run --config experiments/configs/ondevice_spec.py:role=draft,steps=8000 --host-devices 1 --workdir /tmp/od_draft
  python -m ondevice.export --workdir /tmp/od_target --out /tmp/od_target_q8.gguf --quant q8_0
  python -m ondevice.export --workdir /tmp/od_draft --out /tmp/od_draft_q8.gguf --quant q8_0
  python -m ondevice.bench --model /tmp/od_target_q8.gguf --suite spec --draft /tmp/od_draft_q8.gguf
  python -m ondevice.bench --model /tmp/od_target_q8.gguf --suite ring --devices benchmarks/ondevice_devices4.yaml \
      --draft /tmp/od_draft_q8.gguf --tokens 24
"""
import ml_collections

from framework.config_file import parse_arg

SHAPES = {
    "target": dict(d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=384),
    "draft": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192),
}


def get_config(arg=None):
  a = parse_arg(arg, role="target", steps=200)
  c = ml_collections.ConfigDict()
  c.name = f"ondevice_spec_{a.role}"
  c.model = dict(vocab_size=256, max_seq_len=512, rope_theta=10000.0, tie_embeddings=False, remat="none",
                 scan_layers=True, dtype="float32", param_dtype="float32", **SHAPES[a.role])
  c.data = dict(corpus="stdlib", seq_len=64, global_batch=8, seed=0)
  c.optim = dict(lr=3e-3, warmup_steps=20, weight_decay=0.1, grad_clip=1.0)
  c.mesh = dict(data=1, tensor=1, fsdp=1, sequence=1, pipeline=1, rules="default", form="jit")
  c.checkpoint = dict(every=a.steps, keep=1, async_save=False)
  c.train = dict(steps=a.steps, log_every=25, eval_every=a.steps, eval_batches=4, sample_tokens=80,
                 sample_prompt="def ", progress=False)
  c = ml_collections.ConfigDict(c.to_dict())
  c.lock()
  return c
