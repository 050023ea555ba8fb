"""Emulation validation: real 2-process localhost runs vs one real rank with virtual peers.

A 3.28M-parameter Llama (the quickstart model) trained with explicit collectives (form=shard_map) on
2 ranks in one of three layouts; the variant argument picks it:
  layout=data      data=2                      (gradient all-reduce per step)
  layout=tensor    tensor=2                    (Megatron TP: all-reduces per layer, fwd and bwd)
  layout=pipeline  pipeline=2, 4 micro-batches (GPipe over ppermute; bubble (P-1)/(M+P-1))
Every step is logged (log_every=1) so metrics.jsonl has one step_time_s per step; eval, checkpoints
and sampling are off so the loop times only training steps.

Commands:
  # once per host, before emulating for the cpu target: measure this host's 2-process gloo collective curves
  # (~1 min; into ~/.cache/prismllm/emulate/cpu_gloo.json, which the emulator then reads; without it the emulator
  # prices collectives with the committed perfmodel/emulate/calibration/cpu_gloo.json, the development host's curves)
  python -m perfmodel.emulate.gloo_calibration
  # the real run (one process per core, gloo over loopback)
  python -m experiments.run --config experiments/configs/emulate_validate.py:layout=data --workdir /tmp/ev \
      --processes 2 --host-devices 2
  # its emulation: one real rank, the other virtual
  python -m perfmodel.emulate --config experiments/configs/emulate_validate.py:layout=data --hardware cpu --out /tmp/ev_emu
  # the whole comparison (real vs emulate vs predict vs roofline, interleaved, pinned; ~35 min): writes the committed
  # benchmarks/data/emulate_validate.json and benchmarks/emulate_validate.png
  python -m benchmarks.emulate_validate --rounds 6 --replay --no-alone
Reproduces: benchmarks/data/emulate_validate.json (its row in benchmarks/RESULTS.md) and
benchmarks/emulate_validate.png.
"""
import ml_collections

from framework.config_file import lock, parse_arg

LAYOUTS = {
    "data": dict(data=2),
    "tensor": dict(tensor=2),
    "pipeline": dict(pipeline=2, microbatches=4, schedule="gpipe"),
}


def get_config(arg=None):
  a = parse_arg(arg, layout="data", steps=14, runlocal=False)
  if a.layout not in LAYOUTS:
    raise ValueError(f"layout={a.layout!r}; choose one of {sorted(LAYOUTS)}")
  c = ml_collections.ConfigDict()
  c.name = f"emulate_validate_{a.layout}"
  c.model = dict(vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=768,
                 max_seq_len=256, rope_theta=10000.0, tie_embeddings=False, remat="none", scan_layers=True,
                 dtype="float32", param_dtype="float32")
  c.data = dict(corpus="stdlib", seq_len=128, global_batch=16, seed=0)
  c.optim = dict(lr=3e-3, warmup_steps=20, weight_decay=0.1, grad_clip=1.0)
  c.mesh = dict(data=1, tensor=1, fsdp=1, sequence=1, pipeline=1, rules="default", form="shard_map",
                microbatches=1, schedule="gpipe")
  c.mesh.update(LAYOUTS[a.layout])
  c.checkpoint = dict(every=0, keep=1, async_save=False)
  # peak_flops fixed: skips the start-up matmul probe (it only feeds the MFU column).
  c.train = dict(steps=a.steps, log_every=1, eval_every=0, eval_batches=1, sample_tokens=0, progress=False,
                 peak_flops=1e11)
  if a.runlocal:
    c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128)
    c.data.update(seq_len=32, global_batch=8)
    c.train.update(steps=4)
  return lock(c)
