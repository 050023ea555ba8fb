"""KV-cached, jit-compiled sampler (greedy or temperature)."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from framework import model as model_lib
from framework import tokenizer


@functools.partial(jax.jit, static_argnames=("model", "max_new", "temperature"))
def generate(params, prompt_BxP, rng, *, model: nn.Module, max_new: int, temperature: float = 0.0):
  """Returns BxN new token ids. Prefill writes the prompt's K/V, then one token per loop step."""
  B, Pn = prompt_BxP.shape
  cache = model_lib.init_kv_cache(model.cfg, B, Pn + max_new)
  pos_BxP = jnp.broadcast_to(jnp.arange(Pn), (B, Pn))
  logits_BxPxV, cache = model.apply({"params": params}, prompt_BxP, pos_BxP, cache, 0)

  def pick(logits_BxV, key):
    if temperature <= 0.0:
      return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits_BxV / temperature, axis=-1).astype(jnp.int32)

  rng, key = jax.random.split(rng)
  tok_B = pick(logits_BxPxV[:, -1], key)

  def body(i, carry):
    cache, tok_B, out_BxN, rng = carry
    out_BxN = out_BxN.at[:, i].set(tok_B)
    pos_Bx1 = jnp.full((B, 1), Pn + i, jnp.int32)
    logits_Bx1xV, cache = model.apply({"params": params}, tok_B[:, None], pos_Bx1, cache, Pn + i)
    rng, key = jax.random.split(rng)
    return cache, pick(logits_Bx1xV[:, 0], key), out_BxN, rng

  out_BxN = jnp.zeros((B, max_new), jnp.int32)
  _, _, out_BxN, _ = jax.lax.fori_loop(0, max_new, body, (cache, tok_B, out_BxN, rng))
  return out_BxN


def sample_text(params, model: nn.Module, prompt: str, max_new: int, temperature: float = 0.0, seed: int = 0,
                tok=None) -> str:
  """``prompt`` continued by ``max_new`` tokens of ``tok`` (a framework.tokenizer tokenizer; bytes if None)."""
  tok = tok or tokenizer.Bytes()
  ids = tok.encode(prompt)[None, :]
  out = generate(params, jnp.asarray(ids), jax.random.key(seed), model=model, max_new=max_new,
                 temperature=float(temperature))
  return prompt + tok.decode(jax.device_get(out)[0])
