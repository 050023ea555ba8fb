"""Rematerialisation policies of the layer stack, by name (``model.remat``).

A policy decides which values computed in a layer's forward pass the backward pass may keep; everything
else is recomputed from the layer's input. Two families:

* structural (jax's own): ``full`` keeps nothing, ``dots`` keeps every matmul output, ``dots_no_batch``
  keeps matmuls without batch dimensions (the weight projections; the attention products QK^T and PV have
  batch dimensions, so they are recomputed).
* by name, with MaxText's policy names and semantics: the model tags the output of each weight projection
  with ``jax.ad_checkpoint.checkpoint_name`` (:data:`NAMES`) and a policy keeps a subset of them, on the
  device or (``*_offloaded``) in pinned host memory. Tags are attached only when the policy reads them
  (:func:`uses_names`), so every other policy traces exactly the program it traced before names existed. The
  attention kernels always tag what their backward reads (:data:`ATTENTION_NAMES`; a tag lowers to nothing).
  ``minimal_flash`` keeps ``minimal``'s names and those: only elementwise work is recomputed, which is what a
  PyTorch framework that keeps every activation runs with a flash kernel (MaxText's policy of that name keeps the
  weight matmuls and the attention output).

:data:`RECOMPUTES` states, per policy, which matmul groups of a layer the backward pass runs again;
framework/flops.py prices hardware FLOPs from it and tests/framework/test_remat.py checks it against the
matmuls of the real backward pass.
"""
from __future__ import annotations

import jax

from framework.config import REMAT_POLICIES

QUERY, KEY, VALUE, OUT = "query_proj", "key_proj", "value_proj", "out_proj"
MLP_IN_GATE, MLP_IN_UP, MLP_IN, MLP_OUT = "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo"
# mixture of experts: the tokens an expert-parallel rank received (its experts' input) and the experts' outputs
# back on the sender; kept, the backward pass exchanges no token twice (Megatron recomputes no all-to-all either)
MOE_DISPATCH, MOE_COMBINE = "moe_dispatch", "moe_combine"
NAMES = (QUERY, KEY, VALUE, OUT, MLP_IN_GATE, MLP_IN_UP, MLP_IN, MLP_OUT, MOE_DISPATCH, MOE_COMBINE)
# What an attention kernel's backward reads besides q, k, v: the flash kernels' output and log-sum-exp (tagged in
# their forward rules, framework/attention.py and framework/ring_cudnn.py), the dense kernel's scores. Kept, the
# backward does not run the kernel's forward again. jax's cuDNN kernel cannot be tagged: its forward primitives
# are kept by name (_KERNEL_FORWARDS). Splash (TPU) is neither: under 'minimal_flash' its forward is re-run.
ATTN_OUT, ATTN_LSE, ATTN_SCORES = "attention_out", "attention_lse", "attention_scores"
ATTENTION_NAMES = (ATTN_OUT, ATTN_LSE, ATTN_SCORES)
_KERNEL_FORWARDS = ("dot_product_attention_fwd", "dot_product_attention_fwd_wrapper")

_QKV = (QUERY, KEY, VALUE)
_SAVED_NAMES = {
    "minimal": NAMES,
    "minimal_flash": NAMES + ATTENTION_NAMES,
    "save_qkv_proj": _QKV,
    "save_dot_except_mlp": _QKV + (OUT,),
    "save_out_proj": (OUT,),
}
_OFFLOADED_NAMES = {
    "qkv_proj_offloaded": _QKV,
    "minimal_offloaded": NAMES,
}
OFFLOADED = tuple(_OFFLOADED_NAMES)

# Matmul groups of one layer: qkv (q/k/v projections), attn (QK^T and PV), out (output projection),
# mlp_in (gate and up, or the single input matrix), mlp_out (down projection). What each policy re-runs in
# the backward pass: the groups whose outputs it does not keep and the backward needs. mlp_out never
# appears: its output only feeds the residual sum, whose gradient does not need it, so autodiff drops its
# recomputation (measured: tests/framework/test_remat.py counts the backward's matmuls).
GROUPS = ("qkv", "attn", "out", "mlp_in", "mlp_out")
RECOMPUTES = {
    "none": (),
    "dots": (),
    "full": ("qkv", "attn", "out", "mlp_in"),
    "dots_no_batch": ("attn",),
    "minimal": ("attn",),
    "minimal_flash": (),
    "minimal_offloaded": ("attn",),
    "save_dot_except_mlp": ("attn", "mlp_in"),
    "save_qkv_proj": ("attn", "out", "mlp_in"),
    "qkv_proj_offloaded": ("attn", "out", "mlp_in"),
    "save_out_proj": ("qkv", "attn", "mlp_in"),
}
assert set(RECOMPUTES) == set(REMAT_POLICIES), "every policy states what it recomputes"


def uses_names(remat: str) -> bool:
  """True when the policy selects values by checkpoint name (the model must tag them)."""
  return remat in _SAVED_NAMES or remat in _OFFLOADED_NAMES


def policy(remat: str):
  """The ``jax.checkpoint`` policy for a ``model.remat`` name (``None`` for 'none': no remat at all)."""
  cp = jax.checkpoint_policies
  if remat == "none":
    return None
  if remat == "full":
    return cp.nothing_saveable
  if remat == "dots":
    return cp.checkpoint_dots
  if remat == "dots_no_batch":
    return cp.checkpoint_dots_with_no_batch_dims
  if remat == "minimal_flash":
    names = cp.save_only_these_names(*_SAVED_NAMES[remat])
    return lambda prim, *args, **params: prim.name in _KERNEL_FORWARDS or names(prim, *args, **params)
  if remat in _SAVED_NAMES:
    return cp.save_only_these_names(*_SAVED_NAMES[remat])
  if remat in _OFFLOADED_NAMES:
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(_OFFLOADED_NAMES[remat]),
        offload_src="device", offload_dst="pinned_host")
  raise ValueError(f"model.remat={remat!r}; choose one of {REMAT_POLICIES}")


def check_host_offload(remat: str, platform: str) -> None:
  """Offloading policies need a pinned host memory space on the devices the program is built for.

  Only checkable where such devices are attached; a compile-only target (no local devices of that
  platform) is trusted: TPU and GPU both expose pinned host memory."""
  if remat not in _OFFLOADED_NAMES:
    return
  try:
    devices = jax.devices(platform)
  except RuntimeError:
    return
  kinds = {m.kind for m in devices[0].addressable_memories()}
  if "pinned_host" not in kinds:
    raise ValueError(f"model.remat={remat!r} offloads to pinned host memory, which {platform} devices do not "
                     f"have (memories: {sorted(kinds)}): use the on-device policy "
                     f"{remat.replace('_offloaded', '') if remat == 'minimal_offloaded' else 'save_qkv_proj'}")


def kernel_residuals(o, lse):
  """Tags an attention kernel's output and log-sum-exp in its forward rule (kept by ``minimal_flash``)."""
  return jax.ad_checkpoint.checkpoint_name(o, ATTN_OUT), jax.ad_checkpoint.checkpoint_name(lse, ATTN_LSE)
