"""Shared fixtures: one tiny random Llama (framework init) exported once per session to every quant."""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from framework import model as fm  # noqa: E402
from framework.config import ModelConfig  # noqa: E402

# init_std 0.2 makes logits peaked enough that argmax comparisons are meaningful for random weights.
TINY = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                   init_std=0.2)
PROMPT = list(b"def hello(x):\n  return")


@pytest.fixture(scope="session")
def tiny():
  with jax.numpy_rank_promotion("allow"):  # framework.model.rope broadcasts (B,T,1) x (E/2,)
    model = fm.build(TINY)
    params = fm.init_params(model, jax.random.key(0))
    logits = np.asarray(model.apply({"params": params}, jax.numpy.asarray([PROMPT])))[0]
  return TINY, params, logits


@pytest.fixture(scope="session")
def files(tiny, tmp_path_factory):
  from ondevice import gguf_io
  cfg, params, _ = tiny
  d = tmp_path_factory.mktemp("gguf")
  out = {}
  for q in ("f32", "f16", "q8_0", "q4_0"):
    out[q] = str(d / f"tiny-{q}.gguf")
    gguf_io.export_gguf(params, cfg, out[q], q)
  return out


def replace(cfg, **kw):
  return dataclasses.replace(cfg, **kw)
