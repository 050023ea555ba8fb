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


NO_LLAMA = ("llama-cpp-python not installed: .ci/llama_cpp_wheel.sh (run by .ci/run) installs a build for this CPU "
            "(see ondevice/README.md, 'llama.cpp peer')")


def llama_cpp_peer():
  """The llama.cpp peer for a parity test: skipped where llama-cpp-python is not installed; where it is, a child
  process has decoded a tiny model with it first (ondevice/peer.py), so a build that crashes on this CPU fails
  the test with one line ("the llama.cpp peer crashed ...") instead of killing the test worker."""
  llama_cpp = pytest.importorskip("llama_cpp", reason=NO_LLAMA)
  from ondevice import peer
  res = peer.checked()
  if not res.ok:
    pytest.fail(res.line, pytrace=False)
  return llama_cpp


def replace(cfg, **kw):
  return dataclasses.replace(cfg, **kw)
