"""The weights name map: round trips and the RoPE permutation (framework/names.py)."""
import jax
import numpy as np
import pytest

from framework import model as fm
from framework import names
from framework.config import ModelConfig

CFG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def _rope_adjacent(x_TxNxE, pos_T, theta):
  """llama.cpp NORM rope: rotates adjacent pairs (2j, 2j+1)."""
  e = x_TxNxE.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, e, 2) / e)
  ang = pos_T[:, None, None] * inv[None, None, :]
  c, s = np.cos(ang), np.sin(ang)
  x0, x1 = x_TxNxE[..., 0::2], x_TxNxE[..., 1::2]
  out = np.empty_like(x_TxNxE)
  out[..., 0::2] = x0 * c - x1 * s
  out[..., 1::2] = x0 * s + x1 * c
  return out


def test_permute_unpermute_inverse():
  w = np.random.default_rng(0).normal(size=(4 * 16, 24))
  np.testing.assert_array_equal(names.unpermute_rope(names.permute_rope(w, 4), 4), w)
  assert not np.array_equal(names.permute_rope(w, 4), w)
  with pytest.raises(ValueError, match="n_heads"):
    names.permute_rope(np.zeros((10, 3)), 4)


def test_rope_permutation_makes_adjacent_rope_equal_rotate_half():
  rng = np.random.default_rng(1)
  H, E, D, T = 4, 16, 64, 5
  w_hf = rng.normal(size=(H * E, D)).astype(np.float32)
  x_TxD = rng.normal(size=(T, D)).astype(np.float32)
  pos = np.arange(T) + 3
  with jax.numpy_rank_promotion("allow"):  # framework.model.rope broadcasts (B,T,1)*(E/2,)
    ref = np.asarray(fm.rope((x_TxD @ w_hf.T).reshape(1, T, H, E), pos[None], 10000.0))[0]
  got_perm = _rope_adjacent((x_TxD @ names.permute_rope(w_hf, H).T).reshape(T, H, E), pos, 10000.0)
  # Same rotation, just a different order of dims inside each head: un-permute the outputs to compare.
  got = names.unpermute_rope(got_perm.reshape(T, H * E).T, H).T.reshape(T, H, E)
  np.testing.assert_allclose(got, ref, atol=1e-5)
  # And q.k dot products (what attention sees) are identical without any un-permuting.
  np.testing.assert_allclose(np.einsum("the,she->hts", got_perm, got_perm),
                             np.einsum("the,she->hts", ref, ref), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scan", [True, False])
def test_framework_hf_gguf_round_trip(scan):
  import dataclasses
  cfg = dataclasses.replace(CFG, scan_layers=scan)
  with jax.numpy_rank_promotion("allow"):
    params = fm.init_params(fm.build(cfg), jax.random.key(0))
  hf = names.framework_to_hf(params, cfg)
  assert hf["model.layers.1.self_attn.q_proj.weight"].shape == (cfg.n_heads * cfg.hd, cfg.d_model)
  assert hf["lm_head.weight"].shape == (cfg.vocab_size, cfg.d_model)
  gg = names.framework_to_gguf(params, cfg)
  assert set(gg) >= {"token_embd.weight", "blk.1.attn_k.weight", "output.weight", "output_norm.weight"}
  for conv, arrays in ((names.hf_to_framework, hf), (names.gguf_to_framework, gg)):
    back = conv(arrays, cfg)
    flat_a = jax.tree_util.tree_leaves_with_path(jax.tree.map(np.asarray, fm.nn.meta.unbox(params)))
    flat_b = dict(jax.tree_util.tree_leaves_with_path(back))
    assert len(flat_a) == len(flat_b)
    for k, v in flat_a:
      np.testing.assert_array_equal(flat_b[k], v)


def test_tied_embeddings_have_no_output_and_missing_names_are_explained():
  import dataclasses
  cfg = dataclasses.replace(CFG, tie_embeddings=True)
  with jax.numpy_rank_promotion("allow"):
    params = fm.init_params(fm.build(cfg), jax.random.key(0))
  gg = names.framework_to_gguf(params, cfg)
  assert "output.weight" not in gg
  del gg["blk.0.attn_q.weight"]
  with pytest.raises(KeyError, match="Llama-architecture"):
    names.gguf_to_framework(gg, cfg)
