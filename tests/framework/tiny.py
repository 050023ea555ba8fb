"""A tiny, fast configuration shared by the framework and experiments tests (seconds per run on 2 cores)."""
import jax

from framework.config import Config, from_dict

TINY = {
    "model": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64),
    "data": dict(seq_len=32, global_batch=16, max_bytes=1_000_000),
    "optim": dict(lr=1e-2, warmup_steps=5),
    "mesh": dict(data=8),
    "checkpoint": dict(every=0, async_save=True),
    # peak_flops given: skips the start-up matmul probe (MFU is then relative to 1 TFLOP/s).
    "train": dict(steps=4, log_every=1, progress=False, peak_flops=1e12, sample_tokens=0),
}


def tiny_config(**sections) -> Config:
  """TINY with per-section overrides, e.g. tiny_config(mesh=dict(data=2, tensor=4))."""
  d = {k: dict(v) for k, v in TINY.items()}
  for k, v in sections.items():
    if isinstance(v, dict):
      d.setdefault(k, {}).update(v)
    else:
      d[k] = v
  return from_dict(d)


def use_compilation_cache(directory: str):
  """Persistent XLA compilation cache: the many tiny runs of these tests compile the same few programs
  again and again (each run builds a fresh jit); a hit costs ~0.5 s instead of ~5 s of CPU. Keyed on the
  exact HLO, so it never changes what runs. Returns a function that restores the previous settings."""
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")
  old = {k: jax.config.values[k] for k in keys}
  for k, v in zip(keys, (directory, 0, 0)):
    jax.config.update(k, v)

  def restore():
    for k, v in old.items():
      jax.config.update(k, v)
  return restore
