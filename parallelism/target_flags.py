"""The XLA flags the training frameworks of published runs set per target, with the file each set was read from.

A step compiled for a target (parallelism/targets.py; perfmodel/target.py) gets the compiler options its
framework's published launch scripts set for that chip (``flag_set``), passed as ``compiler_options`` to the
compile. JAX frameworks (MaxText, Paxml) set them themselves; for the PyTorch ones (Megatron-Core / NeMo,
torchtitan, llm-foundry) PrismLLM compiles the JAX equivalent of the model and layout with NVIDIA's JAX flags for
the chip. Flags of a source that the installed compiler no longer has (``dropped``, with the reason) are not
passed: XLA refuses unknown options, and what they asked for is the compiler's default now (asynchronous
collectives) or concerns the runtime, not the program (CUDA graphs, the XLA runtime executable).

``framework_key`` maps a framework's name as the published tables write it ('MaxText (JAX/XLA)', 'NeMo 24.09
(Megatron-Core)', ...) to a key of FRAMEWORKS; None (PrismLLM's own step) compiles with the compiler's defaults.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from framework.config import ConfigError


@dataclasses.dataclass(frozen=True)
class FlagSet:
  name: str
  flags: tuple  # ((option, value as the source wrote it), ...): passed to the compiler
  source: str  # repository, path and commit the flags were read from
  dropped: tuple = ()  # ((option, why it is not passed), ...)


_ASYNC_DEFAULT = "not an option of the installed XLA: collectives are asynchronous by default"
_RUNTIME = "not an option of the installed XLA (a runtime setting, not the compiled program)"

# MaxText's per-target LIBTPU_INIT_ARGS of the published v5e / v5p / v4 tables (same commit as the tables' rows).
_V5E = (("xla_tpu_enable_data_parallel_all_reduce_opt", "true"),
        ("xla_tpu_data_parallel_opt_different_sized_ops", "true"),
        ("xla_tpu_enable_async_collective_fusion", "true"),
        ("xla_tpu_enable_async_collective_fusion_fuse_all_gather", "true"),
        ("xla_tpu_enable_async_collective_fusion_multiple_steps", "true"),
        ("xla_tpu_overlap_compute_collective_tc", "true"),
        ("xla_enable_async_all_gather", "true"))
_V5P = (("xla_tpu_megacore_fusion_allow_ags", "false"), ("xla_enable_async_collective_permute", "true"),
        ("xla_tpu_enable_ag_backward_pipelining", "true")) + tuple(f for f in _V5E if "fuse_all_gather" not in f[0])
# XLA_FLAGS of MaxText's GPU (A3, H100) Llama-2-7B scripts and of NVIDIA's Paxml H100 benchmark.
_GPU_COMMON = (("xla_gpu_enable_latency_hiding_scheduler", "true"), ("xla_gpu_enable_triton_gemm", "false"),
               ("xla_gpu_enable_highest_priority_async_stream", "true"),
               ("xla_gpu_enable_pipelined_all_gather", "true"), ("xla_gpu_enable_pipelined_reduce_scatter", "true"),
               ("xla_gpu_enable_pipelined_all_reduce", "true"),
               ("xla_gpu_enable_all_gather_combine_by_dim", "false"),
               ("xla_gpu_enable_reduce_scatter_combine_by_dim", "false"),
               ("xla_disable_hlo_passes", "rematerialization"))
_GPU_DROPPED = (("xla_gpu_enable_async_all_gather", _ASYNC_DEFAULT),
                ("xla_gpu_enable_async_reduce_scatter", _ASYNC_DEFAULT),
                ("xla_gpu_enable_async_all_reduce", _ASYNC_DEFAULT),
                ("xla_gpu_simplify_all_fp_conversions", "not an option of the installed XLA"),
                ("xla_gpu_graph_level", _RUNTIME + ": CUDA graphs"),
                ("xla_gpu_enable_triton_softmax_fusion", "not an option of the installed XLA"))

FLAG_SETS = {s.name: s for s in (
    FlagSet("xla_defaults", (), "the installed compiler's defaults (PrismLLM sets no XLA flags)"),
    FlagSet("maxtext_v5e", _V5E, "github AI-Hypercomputer/maxtext @76bd53b0f MaxText/configs/v5e/16b.sh "
            "(same LIBTPU_INIT_ARGS in v5e/32b.sh, 64b.sh, 128b.sh)"),
    FlagSet("maxtext_v5p", _V5P, "github AI-Hypercomputer/maxtext @76bd53b0f MaxText/configs/v5p/32b.sh "
            "(same LIBTPU_INIT_ARGS in v5p/64b.sh ... 1024b.sh)"),
    FlagSet("maxtext_v4", (("xla_enable_async_all_gather", "true"),),
            "github AI-Hypercomputer/maxtext @76bd53b0f MaxText/configs/v4/22b.sh and 52b.sh",
            (("TPU_MEGACORE", "MEGACORE_DENSE: a chip configuration, not a compiler option (the target's "
                              "megacore chip config, parallelism/targets.py)"),)),
    FlagSet("maxtext_gpu", _GPU_COMMON + (("xla_gpu_all_reduce_combine_threshold_bytes", "1073741824"),
                                          ("xla_gpu_all_gather_combine_threshold_bytes", "134217728"),
                                          ("xla_gpu_reduce_scatter_combine_threshold_bytes", "134217728"),
                                          ("xla_gpu_enable_while_loop_double_buffering", "true")),
            "github AI-Hypercomputer/maxtext @efb6d9e4a MaxText/configs/a3/llama_2_7b/16vm.sh (2vm-8vm.sh: smaller "
            "combine thresholds, 1vm.sh the same flags)", _GPU_DROPPED),
    FlagSet("nvidia_jax_gpu", _GPU_COMMON + (("xla_gpu_all_reduce_combine_threshold_bytes", "536870912"),
                                             ("xla_gpu_all_gather_combine_threshold_bytes", "536870912"),
                                             ("xla_gpu_reduce_scatter_combine_threshold_bytes", "8388608"),
                                             ("xla_gpu_enable_while_loop_double_buffering", "false")),
            "github NVIDIA/dgxc-benchmarking @35a9aecc8 (143b90d^) paxml/configure.sh",
            _GPU_DROPPED + (("xla_gpu_enable_xla_runtime_executable", _RUNTIME),
                            ("xla_gpu_enable_cudnn_fmha", "not an option of the installed XLA (attention is jax's "
                                                          "cuDNN call, model.attention=cudnn)"))),
)}


# hardware family ('tpu_v5e', ..., 'gpu') -> FLAG_SETS key, per framework
FRAMEWORKS = {
    "maxtext": {"tpu_v5e": "maxtext_v5e", "tpu_v5p": "maxtext_v5p", "tpu_v4": "maxtext_v4", "gpu": "maxtext_gpu"},
    "paxml": {"gpu": "nvidia_jax_gpu"},
    "megatron": {"gpu": "nvidia_jax_gpu"},
    "nemo": {"gpu": "nvidia_jax_gpu"},
    "torchtitan": {"gpu": "nvidia_jax_gpu"},
    "llm-foundry": {"gpu": "nvidia_jax_gpu"},
}


OVERLAP_OPTIONS = ("tp_comm", "grad_reduce", "param_gather")


def overlap_options(text: Optional[str]) -> Optional[tuple]:
  """The overlap options a framework spec ``name:opt,opt`` names (``name:none``: none), or None when the spec
  names only the framework (its published defaults, perfmodel/predict.py OVERLAP)."""
  if not text or ":" not in text:
    return None
  opts = tuple(o.strip() for o in text.split(":", 1)[1].split(",") if o.strip() and o.strip() != "none")
  bad = [o for o in opts if o not in OVERLAP_OPTIONS]
  if bad:
    raise ConfigError(f"framework {text!r}: unknown overlap option {bad[0]!r}; name some of "
                      f"{', '.join(OVERLAP_OPTIONS)} after the colon, or 'none'")
  return opts


def framework_key(text: Optional[str]) -> Optional[str]:
  """A FRAMEWORKS key for a framework named as the published tables name it (None: PrismLLM's own step). A spec
  may name the overlap options after a colon (``megatron:grad_reduce,param_gather``; :func:`overlap_options`)."""
  if not text:
    return None
  overlap_options(text)
  t = text.split(":", 1)[0].lower()
  for key, words in (("maxtext", ("maxtext",)), ("paxml", ("paxml", "praxis")), ("nemo", ("nemo",)),
                     ("megatron", ("megatron",)), ("torchtitan", ("torchtitan",)),
                     ("llm-foundry", ("llm-foundry", "composer"))):
    if t == key or any(w in t for w in words):
      return key
  raise ConfigError(f"unknown framework {text!r}; name one of {', '.join(FRAMEWORKS)} (or none)")


def flag_set(hardware: str, framework: Optional[str]) -> FlagSet:
  """The XLA flags ``framework`` sets for ``hardware`` (the compiler's defaults without a framework, or when the
  framework published none for that chip)."""
  key = framework_key(framework)
  family = hardware if hardware.startswith("tpu") else "gpu"
  return FLAG_SETS[FRAMEWORKS[key].get(family, "xla_defaults") if key else "xla_defaults"]


def compiler_options(fs: FlagSet, hardware: str) -> dict:
  """The flags as ``jax.stages.Lowered.compile(compiler_options=...)`` takes them: typed values for the GPU
  compiler (it parses bools and integers), strings for libtpu (it parses them itself)."""
  if hardware.startswith("tpu"):
    return dict(fs.flags)
  return {k: v == "true" if v in ("true", "false") else int(v) if v.isdigit() else v for k, v in fs.flags}
