"""Typed configs: unknown keys rejected, overrides typed, and every bad input fails before compiling
with a ConfigError that names the fix (framework/config.py, framework/config_file.py)."""
import dataclasses
import json
import logging
import os
import re

import jax
import pytest

from framework import config as config_lib
from framework import config_file, train
from framework.config import Config, ConfigError, ModelConfig
from parallelism.step import build_on_devices
from tests.framework.tiny import tiny_config

QUICKSTART = "experiments/configs/quickstart.py"


def _train(cfg, workdir):
  return train.train_and_evaluate(cfg, workdir, build=build_on_devices)


@pytest.fixture
def compiles():
  """Names of the jitted functions XLA compiles while the test runs (model ones must be absent)."""
  names = []

  class Grab(logging.Handler):
    def emit(self, record):
      m = re.match(r"Compiling jit\((\w+)\)", record.getMessage())
      if m:
        names.append(m.group(1))

  logger = logging.getLogger("jax._src.interpreters.pxla")
  h, old_level, old_prop = Grab(level=logging.WARNING), logger.level, logger.propagate
  logger.addHandler(h)
  logger.setLevel(logging.WARNING)
  logger.propagate = False
  prev = jax.config.jax_log_compiles
  jax.config.update("jax_log_compiles", True)
  try:
    yield names
  finally:
    jax.config.update("jax_log_compiles", prev)
    logger.removeHandler(h)
    logger.setLevel(old_level)
    logger.propagate = old_prop


# ---------------------------------------------------------------- unknown keys, typed overrides

def test_unknown_keys_are_rejected_with_the_known_ones():
  with pytest.raises(ConfigError, match=r"unknown config key\(s\) model.n_layer; known keys of 'model':.*n_layers"):
    config_lib.from_dict({"model": {"n_layer": 4}})
  with pytest.raises(ConfigError, match=r"unknown config section\(s\) \['modle'\]"):
    config_lib.from_dict({"modle": {}})
  with pytest.raises(ConfigError, match=r"unknown config key 'model.n_layer'.*known keys there:.*'n_layers'"):
    config_file.load(QUICKSTART, ["--config.model.n_layer=3"])
  with pytest.raises(ConfigError, match="unknown config key 'trian'"):
    config_file.load(QUICKSTART, ["--config.trian.steps=3"])
  with pytest.raises(ConfigError, match="must look like --config.section.key=value"):
    config_file.load(QUICKSTART, ["--model.n_layers=3"])
  with pytest.raises(ConfigError, match="unknown config argument 'runlcoal'"):
    config_file.load(QUICKSTART + ":runlcoal=True")
  with pytest.raises(ConfigError, match="does not exist"):
    config_file.load("experiments/configs/nope.py")


def test_overrides_are_typed():
  cfg = config_file.load(QUICKSTART, ["--config.model.n_layers=6", "--config.optim.lr=1",
                                      "--config.model.remat=full",
                                      "--config.model.tie_embeddings=True", "--config.data.corpus=/some/dir",
                                      "--config.optim.b2=0.99", "--config.mesh.data=-1"])
  assert cfg.model.n_layers == 6 and type(cfg.model.n_layers) is int
  assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float  # int literal for a float field -> float
  assert cfg.model.remat == "full" and cfg.model.tie_embeddings is True
  assert cfg.data.corpus == "/some/dir" and cfg.optim.b2 == 0.99 and cfg.mesh.data == -1
  # A field of the typed config that the experiment file did not set is still a known key.
  assert config_file.load(QUICKSTART, ["--config.model.head_dim=16"]).model.head_dim == 16
  with pytest.raises(ConfigError, match="model.n_layers must be int, got 3.5"):
    config_file.load(QUICKSTART, ["--config.model.n_layers=3.5"])
  with pytest.raises(ConfigError, match="model.tie_embeddings must be bool"):
    config_file.load(QUICKSTART, ["--config.model.tie_embeddings=1"])
  with pytest.raises(ConfigError, match="model.n_layers must be int"):
    config_lib.from_dict({"model": {"n_layers": "four"}})


def test_runlocal_variant_and_dict_round_trip():
  full, small = config_file.load(QUICKSTART), config_file.load(QUICKSTART + ":runlocal=True")
  assert small.model.n_params() < full.model.n_params() and small.train.steps < full.train.steps
  cfg = dataclasses.replace(small, extras=(("perfmodel", (("target", "h200"),)),))
  back = config_lib.from_dict(json.loads(json.dumps(config_lib.to_dict(cfg))))
  assert back == cfg
  assert config_lib.extras(back, "perfmodel") == {"target": "h200"} and config_lib.extras(back, "nope") == {}


# ---------------------------------------------------------------- bad input -> clear error, before compiling

BAD = {
    "mesh_product": (dict(mesh=dict(data=2, tensor=2)),
                     r"mesh data=2 x tensor=2 needs 4 devices, found 8: change --config.mesh.*"
                     r"xla_force_host_platform_device_count=4"),
    "batch_vs_data_axes": (dict(data=dict(global_batch=12)),
                           r"global_batch=12 is not divisible by the batch axes data x fsdp x expert = 8: "
                           r"use a multiple of 8"),
    "layers_vs_pipeline": (dict(model=dict(n_layers=3), mesh=dict(data=4, pipeline=2, form="shard_map")),
                           r"n_layers=3 is not divisible by mesh.pipeline=2 stages: "
                           r"use a pipeline size that divides 3"),
    "heads_vs_tensor": (dict(model=dict(n_heads=6, n_kv_heads=2), mesh=dict(data=2, tensor=4)),
                        r"not divisible by mesh.tensor=4: pick a tensor axis that divides 2"),
    "corpus_missing": (dict(data=dict(corpus="/nonexistent/corpus")),
                       r"/nonexistent/corpus does not exist; pass a text file or folder \(--config.data.corpus"),
}


def test_compile_probe_sees_compilations(compiles):
  """Positive control: the probe the tests below rely on does report a compilation."""
  def probe_fn(x):
    return x * 3 + 1
  jax.jit(probe_fn)(jax.numpy.arange(5.0)).block_until_ready()
  assert "probe_fn" in compiles


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_fails_before_compiling(case, tmp_path, compiles):
  sections, fix = BAD[case]
  with pytest.raises(ConfigError, match=fix):
    _train(tiny_config(**sections), str(tmp_path / "wd"))
  assert not compiles, f"{case}: compiled {compiles} before the error"


def test_unreadable_corpus_kinds(tmp_path, compiles):
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "image.png").write_bytes(b"\x89PNG")
  with pytest.raises(ConfigError, match=r"no files with extensions .*'.py'.* under .*empty"):
    _train(tiny_config(data=dict(corpus=str(empty))), str(tmp_path / "wd"))
  tiny = tmp_path / "tiny.txt"
  tiny.write_text("too short")
  with pytest.raises(ConfigError, match=r"has \d+ bytes, too few for seq_len=32"):
    _train(tiny_config(data=dict(corpus=str(tiny))), str(tmp_path / "wd"))
  if os.geteuid() != 0:  # root reads mode-000 files, so only a normal user can see this failure
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "a.txt").write_text("x" * 1000)
    os.chmod(locked / "a.txt", 0)
    with pytest.raises(ConfigError, match="cannot read"):
      _train(tiny_config(data=dict(corpus=str(locked))), str(tmp_path / "wd"))
  assert not compiles, compiles


def test_other_validation_errors_name_the_fix():
  ok = tiny_config()
  assert config_lib.validate(ok, 8).mesh.data == 8
  assert config_lib.validate(tiny_config(mesh=dict(data=-1, tensor=2)), 8).mesh.data == 4
  for sections, fix in [
      (dict(model=dict(n_heads=4, n_kv_heads=3)), "not a multiple of model.n_kv_heads=3"),
      (dict(mesh=dict(data=-1, tensor=-1)), "at most one mesh axis may be -1"),
      (dict(mesh=dict(data=3, fsdp=-1)), "cannot fill 8 devices"),
      (dict(model=dict(remat="some")), "choose one of"),
      (dict(mesh=dict(form="pmap")), "choose 'jit' or 'shard_map'"),
      (dict(data=dict(seq_len=128)), "exceeds model.max_seq_len=64"),
      (dict(mesh=dict(data=4, sequence=2), data=dict(seq_len=33)), "not divisible by mesh.sequence=2"),
      (dict(mesh=dict(data=4, tensor=2, tensor_sequence_parallel=True)),
       r"mesh.tensor_sequence_parallel=True .*set --config.mesh.form=shard_map"),
      (dict(mesh=dict(data=2, sequence=2, tensor=2, form="shard_map", tensor_sequence_parallel=True),
            data=dict(seq_len=6)), r"splits each device's 3 tokens .* over mesh.tensor=2: .* multiple of 2"),
  ]:
    with pytest.raises(ConfigError, match=fix):
      config_lib.validate(tiny_config(**sections), 8)
  # sequence parallelism of a tensor axis of size 1 is a no-op: accepted in either form, any length
  sp_off = dict(data=8, tensor_sequence_parallel=True)
  assert config_lib.validate(tiny_config(mesh=sp_off, data=dict(seq_len=7)), 8).mesh.tensor_sequence_parallel
  with pytest.raises(ConfigError, match="not divisible by 3 processes"):
    config_lib.validate(tiny_config(mesh=dict(data=1, fsdp=-1), data=dict(global_batch=8)), 8, n_processes=3)


def test_cli_prints_config_errors_without_a_traceback(monkeypatch, capsys, tmp_path):
  from experiments import run
  monkeypatch.setattr("sys.argv", ["run", "--config", QUICKSTART, "--workdir", str(tmp_path),
                                   "--config.model.n_layer=2"])
  assert run.cli() == 2
  err = capsys.readouterr().err
  assert err.startswith("config error: unknown config key 'model.n_layer'") and "Traceback" not in err


def test_model_config_counts():
  m = ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, d_ff=0)
  assert m.ff == 192 and m.hd == 16  # Llama rule: 8/3 * 64 -> multiple of 64
  assert Config().model == ModelConfig()


def test_model_kind_errors_name_the_fix():
  """Kernel, MLP, remat and width choices fail in validate(), before anything compiles."""
  for sections, fix in [
      (dict(model=dict(attention="flash")), r"model.attention='flash'; choose one of \('dense', 'blockwise'"),
      (dict(model=dict(mlp="geglu")), r"model.mlp='geglu'; choose one of \('swiglu', 'gelu', 'relu'\)"),
      (dict(model=dict(remat="save_everything")), r"model.remat='save_everything'; choose one of .*'minimal'"),
      (dict(model=dict(head_dim=-8)), r"model.head_dim=-8 must be positive \(or 0 for d_model // n_heads\)"),
      (dict(model=dict(head_dim=15)), r"head_dim=15 is odd; RoPE rotates pairs"),
      (dict(model=dict(d_model=96, n_heads=32, n_kv_heads=8)), r"head_dim=3 is odd; RoPE rotates pairs: set "
                                                                 r"model.head_dim to an even width"),
      (dict(model=dict(attention_block=0)), r"model.attention_block=0 must be a positive number of keys"),
      (dict(model=dict(attention="blockwise", attention_block=12)),
       r"model.attention_block=12 does not divide data.seq_len=32: use a divisor of 32 \(e.g. 8\)"),
      (dict(model=dict(attention="splash", attention_block=128)), r"splash' tiles by multiples of 128.*seq_len=32"),
      (dict(model=dict(attention="splash", attention_block=128, max_seq_len=256), data=dict(seq_len=256),
            mesh=dict(form="shard_map")), r"splash' runs in mesh.form='jit' without pipeline stages"),
      (dict(model=dict(attention="splash", attention_block=128, max_seq_len=256), data=dict(seq_len=256),
            mesh=dict(data=4, sequence=2)), r"splash' does not support mesh.sequence > 1"),
      (dict(model=dict(attention="cudnn")), r"'cudnn' needs 16-bit compute, got model.dtype='float32': set "
                                            r"model.dtype=bfloat16"),
      (dict(model=dict(matmul_precision="int8")),
       r"model.matmul_precision='int8'; choose one of \('default', 'fp8'\)"),
      (dict(model=dict(vocab_size=257), mesh=dict(data=2, tensor=4, form="shard_map")),
       r"vocab_size=257 is not divisible by mesh.tensor=4 .*--config.model.vocab_size=260"),
      (dict(optim=dict(master_weights=True)), r"model.param_dtype is float32 \(the parameters are their own "
                                              r"masters\): set model.param_dtype=bfloat16, or optim.master_weights"),
  ]:
    with pytest.raises(ConfigError, match=fix):
      config_lib.validate(tiny_config(**sections), 8)
  # the same choices, valid
  for model in (dict(attention="blockwise", attention_block=8), dict(attention="blockwise", attention_block=512),
                dict(mlp="relu", head_dim=24), dict(attention="cudnn", dtype="bfloat16"),
                dict(remat="minimal_offloaded", attention="dot_product"), dict(matmul_precision="fp8")):
    config_lib.validate(tiny_config(model=model), 8)
  config_lib.validate(tiny_config(model=dict(param_dtype="bfloat16"), optim=dict(master_weights=True,
                                                                                 shard_optimizer_state=True)), 8)


def test_kind_overrides_from_the_command_line():
  cfg = config_file.load(QUICKSTART, ["--config.model.attention=blockwise", "--config.model.attention_block=64",
                                      "--config.model.mlp=gelu", "--config.model.remat=save_qkv_proj"])
  assert (cfg.model.attention, cfg.model.attention_block, cfg.model.mlp, cfg.model.remat) == (
      "blockwise", 64, "gelu", "save_qkv_proj")
  assert cfg.model.ff == 768  # quickstart sets d_ff explicitly; gelu's 4 x d_model default applies only at 0
