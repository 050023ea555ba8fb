"""The XLA flags of the published frameworks (parallelism/target_flags.py): named for every framework of the
published tables, accepted by the installed compilers (an unknown option aborts a compile), the dropped ones truly
unknown, and really in the compile (the GPU program changes with them)."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from framework.config import ConfigError
from parallelism import target_flags as tf
from parallelism import targets

HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA = importlib.util.find_spec("jax_plugins") is not None and \
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None

# the framework column of the published-runs table, as its rows write it
PUBLISHED = {"MaxText (JAX/XLA)": "maxtext", "MaxText (JAX/XLA GPU)": "maxtext",
             "MaxText (JAX/XLA) @f586e43f, MLPerf v4.0": "maxtext", "Paxml/Praxis (JAX/XLA GPU) 24.11": "paxml",
             "Megatron-Core (r0.8.0 per figure legend)": "megatron", "Megatron-LM (2021)": "megatron",
             "NeMo 24.09 (Megatron-Core)": "nemo", "Megatron-Bridge / NeMo 25.11 (Megatron-Core)": "nemo",
             "torchtitan (FSDP2+TP) +torch.compile": "torchtitan",
             "llm-foundry/Composer (PyTorch FSDP FULL_SHARD)": "llm-foundry"}


def test_every_published_framework_has_a_key_and_every_set_a_source():
  assert {k: tf.framework_key(k) for k in PUBLISHED} == PUBLISHED
  assert tf.framework_key(None) is None
  with pytest.raises(ConfigError, match="unknown framework 'jaxformer'; name one of maxtext"):
    tf.framework_key("jaxformer")
  assert tf.flag_set("tpu_v5e", "MaxText (JAX/XLA)").name == "maxtext_v5e"
  assert tf.flag_set("tpu_v5p", "maxtext").name == "maxtext_v5p"
  assert tf.flag_set("h100", "NeMo 24.09 (Megatron-Core)").name == "nvidia_jax_gpu"
  assert tf.flag_set("tpu_v6e", "maxtext").name == tf.flag_set("h100", None).name == "xla_defaults"
  for fs in tf.FLAG_SETS.values():
    assert fs.source and (fs.name == "xla_defaults" or "github " in fs.source)
    assert not {k for k, _ in fs.flags} & {k for k, _ in fs.dropped}


def _tiny(hardware):
  mesh = Mesh(np.array(targets.compile_only_devices(hardware, 8)), ("d",))
  sd = lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, P("d", None)))  # noqa: E731
  return jax.jit(lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w.T)))(w)).lower(sd((512, 512)),
                                                                                       sd((1024, 512)))


@pytest.mark.skipif(not HAS_CUDA, reason=f"needs the CUDA plugin ({targets.INSTALL})")
def test_gpu_flag_sets_compile_their_dropped_flags_are_unknown_and_they_change_the_program():
  lowered = _tiny("h100")
  default = lowered.compile().as_text()
  for name in ("maxtext_gpu", "nvidia_jax_gpu"):
    fs = tf.FLAG_SETS[name]
    text = lowered.compile(tf.compiler_options(fs, "h100")).as_text()
    # xla_gpu_enable_triton_gemm=false: the matmuls go to cuBLAS instead of Triton gemm fusions
    assert "__cublas$lt$matmul" in text and "__cublas" not in default and "gemm_fusion" in default, name
    for flag, _ in fs.dropped:
      if flag.startswith("xla_"):
        with pytest.raises(Exception, match="No such compile option"):
          lowered.compile({flag: True})


@pytest.mark.skipif(not HAS_TPU, reason=f"needs libtpu ({targets.INSTALL})")
def test_tpu_flag_sets_are_options_of_the_installed_libtpu():
  lowered = _tiny("tpu_v5e")
  flags = {}
  for name in ("maxtext_v5e", "maxtext_v5p", "maxtext_v4"):
    flags.update(tf.compiler_options(tf.FLAG_SETS[name], "tpu_v5e"))
  assert lowered.compile(flags).as_text()
  with pytest.raises(Exception, match="No such compile option"):
    lowered.compile({"xla_tpu_enable_async_collective_fusion_no_such_flag": "true"})


def test_a_framework_spec_names_its_overlap_options():
  assert tf.framework_key("megatron:grad_reduce,param_gather") == "megatron"
  assert tf.overlap_options("megatron") is None  # the framework's published defaults
  assert tf.overlap_options("megatron:grad_reduce, tp_comm") == ("grad_reduce", "tp_comm")
  assert tf.overlap_options("nemo:none") == ()
  assert tf.flag_set("h100", "torchtitan:tp_comm").name == "nvidia_jax_gpu"
  with pytest.raises(ConfigError, match="unknown overlap option 'dp_overlap'; name some of tp_comm"):
    tf.framework_key("megatron:dp_overlap")
