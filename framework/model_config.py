"""The model section of the configuration: :class:`ModelConfig` (framework/model.py's decoder), the names its
string keys may take, and :func:`validate_model`. framework/config.py re-exports all of it (``config.ModelConfig``)
with the other sections; :class:`ConfigError` lives here, the lowest config module, so both raise the same error.
"""
from __future__ import annotations

import dataclasses
import math

# What each name does: framework/remat.py (policies), framework/attention.py (kernels), MLP below.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "minimal", "minimal_flash", "save_qkv_proj",
                  "save_dot_except_mlp", "save_out_proj", "qkv_proj_offloaded", "minimal_offloaded")
ATTENTION_KINDS = ("dense", "blockwise", "dot_product", "cudnn", "splash", "ring")
MLP_KINDS = ("swiglu", "gelu", "relu")
BLOCK_KINDS = ("sequential", "parallel")
MATMUL_PRECISIONS = ("default", "fp8")  # what each does: framework/fp8.py
ROPE_SCALINGS = ("none", "llama3")  # what each does: framework/rope.py
ROUTERS = ("softmax", "sigmoid")  # what each does: framework/moe.py
MOE_IMPLS = ("dropless", "capacity")


class ConfigError(ValueError):
  """A configuration that cannot run; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The decoder (framework/model.py). Keys beyond the Llama shape:

  ``head_dim``: per-head width E; 0 means ``d_model // n_heads``. Any positive even value is allowed, so
  ``n_heads * head_dim`` may differ from ``d_model`` (e.g. head_dim 256 with fewer heads); wq/wk/wv map
  D -> heads x E and wo maps heads x E -> D.

  ``mlp``: ``swiglu`` (Llama: ``w_down(silu(x w_gate) * x w_up)``, 3 matrices), ``gelu`` or ``relu``
  (GPT: ``w_down(act(x w_up))``, 2 matrices, no w_gate; gelu is the tanh approximation). ``d_ff=0`` picks
  the family's width: 8/3 * d_model rounded up to a multiple of 64 for swiglu, 4 * d_model otherwise.

  ``block``: ``sequential`` (Llama: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``, two norms per layer) or
  ``parallel`` (PaLM / GPT-J, and MaxText's 2023 decoder layer: ``x + attn(norm(x)) + mlp(norm(x))``, one norm
  whose output both branches read).

  ``attention``: the kernel of causal self-attention in training and prefill (framework/attention.py);
  every kind computes the same function, they differ in memory, speed and where they run.
  * ``dense``: scores materialised as T x S (f32), masked softmax. Runs everywhere.
  * ``blockwise``: online softmax over key/value blocks of ``attention_block`` keys, with a hand-written
    backward that recomputes each block, so neither pass holds more than T x block scores. Runs everywhere,
    supports sequence parallelism (it masks by global positions).
  * ``dot_product``: ``jax.nn.dot_product_attention`` with the implementation left to XLA.
  * ``cudnn``: the same with ``implementation='cudnn'`` (fused flash attention); GPU only, needs
    ``dtype`` bfloat16 or float16.
  * ``ring``: context parallelism as Llama 3 / NeMo run it: with ``mesh.sequence = C > 1`` in the shard_map forms,
    K/V blocks go around the ``sequence`` ring (C-1 ``ppermute`` hops, no all-gather), each folded into the
    blockwise online softmax, over the zig-zag layout (a device holds sequence chunks ``i`` and ``2C-1-i``) that
    gives every device the same causal work; needs ``seq_len`` divisible by ``2C``, and no pipeline stages (their
    idle slots would not join the ring's collectives). Elsewhere (``sequence = 1``, or ``mesh.form='jit'``,
    where GSPMD all-gathers K/V) it computes as ``blockwise``.
  * ``splash``: Pallas splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``); TPU only,
    decided by the platform of the mesh the program is built for (a compile-only TPU target lowers from any
    host). Block size ``min(attention_block, seq)``, multiples of 128; ``mesh.form='jit'`` without pipeline
    stages and without sequence parallelism.
  The KV-cached decode path always uses ``dense``: its queries are a few new tokens against the cache.

  ``attention_block``: keys per block for ``blockwise`` / ``ring`` and the splash block size; must divide
  ``data.seq_len`` when smaller than it.

  ``remat``: what the backward pass may keep from the forward of each layer (framework/remat.py):
  ``none`` (everything), ``full`` (nothing: the layer's input only), ``dots`` (every matmul output),
  ``dots_no_batch`` (matmuls without batch dimensions, i.e. the projections, not the attention products),
  and MaxText's named policies, which save the outputs named in the model (``query_proj``, ``key_proj``,
  ``value_proj``, ``out_proj``, ``mlpwi_0``/``mlpwi_1`` (gated) or ``mlpwi``, ``mlpwo``): ``minimal`` (all
  of them), ``save_qkv_proj``, ``save_dot_except_mlp`` (q/k/v/out), ``save_out_proj``; and
  ``qkv_proj_offloaded`` / ``minimal_offloaded``, which move the same values to pinned host memory
  instead of keeping them on the device.

  ``dtype`` is the compute dtype (activations, matmul inputs); ``param_dtype`` the stored parameters' dtype.
  ``param_dtype=bfloat16`` with ``optim.master_weights=True`` is Megatron's mixed precision: bf16 weights in
  compute, float32 master copies and moments in the optimizer state.

  ``matmul_precision``: ``default`` runs every matmul in ``dtype``; ``fp8`` runs the layers' projections
  (q/k/v/out and the MLP) as scaled fp8 matmuls, e4m3 inputs forward and e5m2 gradients backward, each tensor
  scaled by its current absolute maximum (torchtitan's dynamic tensorwise scaling; framework/fp8.py). The LM
  head and attention's score / value products stay in ``dtype``.

  ``rope_scaling``: ``none`` (plain RoPE of ``rope_theta``) or ``llama3`` (Llama 3.1's frequency scaling, by
  ``rope_factor``, ``rope_low_freq_factor``, ``rope_high_freq_factor`` and ``rope_original_max_len``, the keys
  of transformers' ``rope_scaling``; framework/rope.py). The four keys are read only with ``llama3``.

  ``qkv_bias``: q/k/v projections with biases (Qwen2); each bias is sharded like its projection's heads.

  Mixture of experts (framework/moe.py), on when ``n_experts > 0``: every layer's MLP is replaced by ``n_experts``
  gated experts of width ``moe_d_ff`` (0: ``d_ff``), of which a router picks ``experts_per_token`` per token, plus
  ``n_shared_experts`` experts every token goes through (DeepSeek). ``router``: ``softmax`` (Mixtral, Qwen3: the
  top-k of the softmax, renormalised over the k with ``moe_norm_topk``) or ``sigmoid`` (DeepSeek-V3: per-expert
  sigmoid scores, the top-k renormalised); the routed output is scaled by ``router_scale``. ``moe_impl``:
  ``dropless`` (every assignment computed: tokens sorted by expert, grouped matmuls ``jax.lax.ragged_dot``) or
  ``capacity`` (each expert takes at most ``capacity_factor x tokens x k / n_experts`` tokens from each device,
  the rest are dropped and counted). ``aux_loss_coef``: weight of the load-balancing loss, computed per sequence
  (DeepSeek-V3's sequence-wise form of the Switch loss: ``E/k x sum_e f_e P_e``), averaged over layers and
  sequences and added to the cross-entropy. ``router_bias_rate`` > 0: DeepSeek-V3's auxiliary-loss-free balancing,
  a per-expert bias added to the scores to select the experts (not to weight them), moved after every step by
  ``rate`` toward balance (framework/moe.py ``update_bias``); it lives in the params, untouched by the optimizer.
  The expert dimension is sharded over ``mesh.expert``.
  """
  vocab_size: int = 256  # byte-level tokenizer
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 8
  n_kv_heads: int = 4  # grouped-query attention: n_heads % n_kv_heads == 0
  head_dim: int = 0  # 0 -> d_model // n_heads; otherwise any positive even width
  d_ff: int = 0  # 0 -> swiglu: 8/3 * d_model rounded up to a multiple of 64; gelu/relu: 4 * d_model
  mlp: str = "swiglu"  # one of MLP_KINDS
  block: str = "sequential"  # one of BLOCK_KINDS
  attention: str = "dense"  # one of ATTENTION_KINDS
  attention_block: int = 512  # keys per block (blockwise) / splash block size
  rope_theta: float = 10000.0
  rope_scaling: str = "none"  # one of ROPE_SCALINGS (framework/rope.py)
  rope_factor: float = 8.0  # llama3: divisor of the low frequencies
  rope_low_freq_factor: float = 1.0  # llama3: wavelengths above rope_original_max_len / this are divided
  rope_high_freq_factor: float = 4.0  # llama3: wavelengths below rope_original_max_len / this are kept
  rope_original_max_len: int = 8192  # llama3: the context length the model was pretrained with
  qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  max_seq_len: int = 256
  dtype: str = "float32"  # activation / compute dtype
  param_dtype: str = "float32"
  remat: str = "none"  # one of REMAT_POLICIES
  matmul_precision: str = "default"  # one of MATMUL_PRECISIONS
  scan_layers: bool = True
  init_std: float = 0.02
  n_experts: int = 0  # 0: dense MLP; > 0: a mixture of experts in every layer (framework/moe.py)
  experts_per_token: int = 2  # top-k
  moe_d_ff: int = 0  # width of one expert; 0 -> d_ff
  n_shared_experts: int = 0  # experts every token goes through (DeepSeek), of width moe_d_ff each
  router: str = "softmax"  # one of ROUTERS
  moe_norm_topk: bool = True  # renormalise the k gate weights to sum to 1
  router_scale: float = 1.0  # routed output scale (DeepSeek-V3: 2.5)
  moe_impl: str = "dropless"  # one of MOE_IMPLS
  capacity_factor: float = 1.25  # moe_impl='capacity': slots per expert = factor x tokens x k / n_experts
  aux_loss_coef: float = 0.01  # load-balancing loss weight (0: none)
  router_bias_rate: float = 0.0  # > 0: DeepSeek-V3's auxiliary-loss-free balancing, the bias update speed (V3: 0.001)

  @property
  def hd(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def ff(self) -> int:
    if self.d_ff:
      return self.d_ff
    if not self.gated:
      return 4 * self.d_model
    return int(math.ceil(8 * self.d_model / 3 / 64) * 64)

  @property
  def gated(self) -> bool:
    """True when the MLP has a gate matrix (3 matrices of D x F instead of 2)."""
    return self.mlp == "swiglu"

  @property
  def mlp_matrices(self) -> int:
    return 3 if self.gated else 2

  @property
  def moe(self) -> bool:
    return self.n_experts > 0

  @property
  def expert_ff(self) -> int:
    """Width of one routed (and one shared) expert."""
    return self.moe_d_ff or self.ff

  def ffn_params(self, active: bool = False) -> int:
    """Parameters of one layer's feed-forward part: the MLP, or router + experts + shared experts (``active``: only
    the ``experts_per_token`` experts a token goes through, the count that sets its FLOPs)."""
    if not self.moe:
      return self.mlp_matrices * self.d_model * self.ff
    routed = self.experts_per_token if active else self.n_experts
    return self.d_model * self.n_experts + (routed + self.n_shared_experts) * 3 * self.d_model * self.expert_ff

  def n_params(self, embeddings: bool = True) -> int:
    """Exact parameter count of the model built from this config."""
    d, h, kv, hd = self.d_model, self.n_heads, self.n_kv_heads, self.hd
    per_layer = (1 if self.block == "parallel" else 2) * d + d * h * hd + 2 * d * kv * hd + h * hd * d + self.ffn_params()
    if self.qkv_bias:
      per_layer += (h + 2 * kv) * hd
    n = self.n_layers * per_layer + d
    if embeddings:
      n += self.vocab_size * d * (1 if self.tie_embeddings else 2)
    elif not self.tie_embeddings:
      n += self.vocab_size * d  # the LM head is a matmul: it counts as compute params
    return n


def validate_model(m: ModelConfig) -> None:
  """Checks of the model section alone (names, widths, RoPE scaling keys); ``config.validate`` calls it."""
  for key, value, choices in (("remat", m.remat, REMAT_POLICIES), ("attention", m.attention, ATTENTION_KINDS),
                              ("mlp", m.mlp, MLP_KINDS), ("block", m.block, BLOCK_KINDS),
                              ("matmul_precision", m.matmul_precision, MATMUL_PRECISIONS),
                              ("rope_scaling", m.rope_scaling, ROPE_SCALINGS), ("router", m.router, ROUTERS),
                              ("moe_impl", m.moe_impl, MOE_IMPLS)):
    if value not in choices:
      raise ConfigError(f"model.{key}={value!r}; choose one of {choices}")
  if m.head_dim < 0:
    raise ConfigError(f"model.head_dim={m.head_dim} must be positive (or 0 for d_model // n_heads)")
  if m.hd % 2:
    raise ConfigError(f"head_dim={m.hd} is odd; RoPE rotates pairs: set model.head_dim to an even width")
  if m.d_ff < 0:
    raise ConfigError(f"model.d_ff={m.d_ff} must be positive (or 0 for the MLP family's default width)")
  if m.attention_block <= 0:
    raise ConfigError(f"model.attention_block={m.attention_block} must be a positive number of keys")
  if m.n_experts < 0 or m.moe_d_ff < 0 or m.n_shared_experts < 0:
    raise ConfigError("model.n_experts, moe_d_ff and n_shared_experts must be >= 0")
  if m.moe and not 1 <= m.experts_per_token <= m.n_experts:
    raise ConfigError(f"model.experts_per_token={m.experts_per_token} must be between 1 and "
                      f"model.n_experts={m.n_experts}")
  if m.moe and not m.gated:
    raise ConfigError(f"model.n_experts > 0 builds gated (swiglu) experts; model.mlp={m.mlp!r}: set model.mlp=swiglu")
  if m.moe and m.capacity_factor <= 0:
    raise ConfigError(f"model.capacity_factor={m.capacity_factor} must be > 0")
  if m.router_bias_rate < 0 or (m.router_bias_rate and not m.moe):
    raise ConfigError(f"model.router_bias_rate={m.router_bias_rate} balances the experts' routing: use a rate >= 0 "
                      f"with model.n_experts > 0 (DeepSeek-V3: 0.001)")
  if m.rope_scaling == "llama3":
    if not (m.rope_factor > 0 and m.rope_original_max_len > 0
            and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor):
      raise ConfigError(f"model.rope_scaling='llama3' needs rope_factor > 0, rope_original_max_len > 0 and "
                        f"0 < rope_low_freq_factor < rope_high_freq_factor; got {m.rope_factor}, "
                        f"{m.rope_original_max_len}, {m.rope_low_freq_factor}, {m.rope_high_freq_factor}")
