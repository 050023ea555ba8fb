"""`ondevice.export --workdir`: a training workdir (config.json + orbax checkpoint) -> GGUF -> same logits."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from framework import checkpoint as ckpt_lib
from framework import config as config_lib
from ondevice import forward, gguf_io, sources
from ondevice.weights import MappedGGUF

from .conftest import PROMPT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_workdir(workdir, cfg_model, params, step):
  """What framework/train.py leaves behind, with the params sharded over an 8-device mesh as in a real run
  (a target-less orbax restore fails on exactly this: 'Topology mismatch')."""
  cfg = sources.config_from_file(os.path.join(ROOT, "experiments/configs/quickstart.py:runlocal=True"))
  cfg = dataclasses.replace(cfg, model=cfg_model)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(config_lib.to_dict(cfg), f, default=str)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
  def put(x):  # shard the last axis over 'tensor' when it divides, else replicate
    spec = P(*([None] * (x.ndim - 1) + ["tensor"])) if x.ndim and x.shape[-1] % 4 == 0 else P()
    return jax.device_put(x, NamedSharding(mesh, spec))
  from flax.core import meta
  sharded = jax.tree_util.tree_map(put, meta.unbox(params))  # train.py's state holds unboxed params
  state = {"params": sharded, "opt_state": optax.adam(1e-3).init(sharded), "step": jax.numpy.int32(step)}
  ck = ckpt_lib.Checkpointer(workdir, config_lib.CheckpointConfig(every=1, keep=2, async_save=False))
  ck.save(step, state, {"pos": 0}, force=True)
  ck.close()
  return cfg


def test_export_workdir_matches_framework_logits(tiny, tmp_path):
  cfg_model, params, ref = tiny
  wd = str(tmp_path / "wd")
  _write_workdir(wd, cfg_model, params, step=3)
  got_params, cfg, step = sources.workdir_params(wd)
  assert step == 3 and cfg.model == cfg_model
  from flax.core import meta
  assert jax.tree_util.tree_structure(got_params) == jax.tree_util.tree_structure(meta.unbox(params))
  for a, b in zip(jax.tree_util.tree_leaves(got_params), jax.tree_util.tree_leaves(meta.unbox(params))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  out = str(tmp_path / "wd.gguf")
  gguf_io.export_gguf(got_params, cfg.model, out, "f32")
  m = forward.GGUFLlama(MappedGGUF(out))
  got = m.forward(PROMPT, 0, m.new_cache())
  assert np.abs(got - ref).max() <= 1e-5 * max(1.0, float(np.abs(ref).max()))
  with pytest.raises(FileNotFoundError, match="steps present"):
    sources.workdir_params(wd, step=7)


def test_export_refuses_a_config_that_does_not_match_the_checkpoint(tiny, tmp_path):
  """config.json rewritten for another width over a checkpoint of this one: one error line, no GGUF written."""
  cfg_model, params, _ = tiny
  wd = str(tmp_path / "wd")
  cfg = _write_workdir(wd, cfg_model, params, step=2)
  wrong = config_lib.to_dict(dataclasses.replace(cfg, model=dataclasses.replace(cfg_model, d_model=32, n_heads=2)))
  with open(os.path.join(wd, "config.json"), "w") as f:
    json.dump(wrong, f, default=str)
  from benchmarks.reliability.ondevice_area import classify, invoke
  from ondevice.errors import InputError
  with pytest.raises(InputError, match=r"config.json does not describe checkpoint step 2 .*params\['embed'\]"):
    sources.workdir_params(wd)
  out = str(tmp_path / "x.gguf")
  r = invoke("ondevice.export", ["--workdir", wd, "--out", out])
  err = r.err
  assert classify(r).kind == "clear_error", err
  assert "is (256, 64) there, the config's model needs (256, 32)" in err and not os.path.exists(out)


def test_export_workdir_errors_name_the_fix(tmp_path):
  with pytest.raises(FileNotFoundError, match="experiments.run --workdir"):
    sources.workdir_params(str(tmp_path))
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(Exception):
    sources.workdir_params(str(tmp_path))


@pytest.mark.slow  # a real (4-step) training run + export CLI: ~1-2 min on the loaded 2-core machine
@pytest.mark.entry
def test_train_then_export_cli(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1")
  wd, out = str(tmp_path / "wd"), str(tmp_path / "qs.gguf")
  r = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                      "experiments/configs/quickstart.py:runlocal=True", "--workdir", wd],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:]
  r = subprocess.run([sys.executable, "-m", "ondevice.export", "--workdir", wd, "--out", out, "--quant", "q8_0"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  summary = json.loads(r.stdout.strip().splitlines()[-1])
  assert summary["quant"] == "q8_0" and "step 4" in summary["origin"]
  r = subprocess.run([sys.executable, "-m", "ondevice.run", "--model", out, "--prompt", "def ", "--max-tokens", "4",
                      "--greedy", "--no-stop"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and r.stdout.startswith("def "), r.stderr[-2000:]
