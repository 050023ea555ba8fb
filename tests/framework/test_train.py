"""The training loop on real text, metrics, and exact resume from orbax checkpoints
(framework/train.py, framework/checkpoint.py)."""
import json

import flax.linen as nn
import jax
import numpy as np
import pytest

from framework import checkpoint as ckpt_lib
from framework import config as config_lib
from framework import data as data_lib
from framework import train
from framework.config import CheckpointConfig
from parallelism.mesh import make_mesh
from parallelism.step import build_on_devices, build_step
from tests.framework.tiny import tiny_config


def _unigram_entropy(cfg) -> float:
  """Entropy (nats/byte) of the corpus's byte frequencies: the best loss without any context."""
  p = np.bincount(data_lib.load_corpus(cfg.data), minlength=256) / cfg.data.max_bytes
  p = p[p > 0]
  return float(-(p * np.log(p)).sum())


def _records(workdir):
  with open(f"{workdir}/metrics.jsonl") as f:
    return [json.loads(line) for line in f]


def test_loss_falls_on_real_text(tmp_path):
  """30 steps of a 0.1M-parameter model on the stdlib source: the held-out loss must drop from ln(256)
  to below the corpus's unigram entropy, i.e. the model uses context, not just byte frequencies."""
  cfg = tiny_config(data=dict(seq_len=64), train=dict(steps=30, log_every=5, eval_every=30, eval_batches=2,
                                                       sample_tokens=8))
  s = train.train_and_evaluate(cfg, str(tmp_path), build=build_on_devices)
  h0 = _unigram_entropy(cfg)  # ~3.2 nats/byte for Python source
  recs = _records(tmp_path)
  assert abs(s["first_loss"] - np.log(256)) < 0.1, s["first_loss"]
  ev = [r["eval_loss"] for r in recs if "eval_loss" in r]
  assert len(ev) == 1 and ev[0] < h0 - 0.15, (ev, h0)
  logged = [r for r in recs if "mfu" in r]
  assert [r["step"] for r in logged] == [5, 10, 15, 20, 25, 30]
  for r in logged:
    assert {"step", "loss", "step_time_s", "tokens_per_s", "mfu"} <= set(r)
    assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    assert r["tokens_per_s"] == pytest.approx(16 * 64 / r["step_time_s"])
  assert logged[-1]["loss"] < logged[0]["loss"] - 0.5
  assert s["sample"].startswith("def ") and len(s["sample"].encode()) >= 4 + 8 - 3  # 8 bytes, maybe split UTF-8
  assert (tmp_path / "sample.txt").read_text() == s["sample"]
  assert json.loads((tmp_path / "config.json").read_text())["model"]["d_model"] == 64


def test_save_restore_next_step_bit_identical(tmp_path):
  """Save after 2 steps, restore into a fresh process-like setup, take step 3: identical bits."""
  # The tiny config (data=8) compiles the same programs as test_interrupted_run_resumes_exactly: one
  # compilation serves both through the session's compilation cache.
  cfg = config_lib.validate(tiny_config(), jax.device_count())
  corpus = data_lib.load_corpus(cfg.data)
  step = build_step(cfg, make_mesh(cfg.mesh))
  it = data_lib.BatchIterator(corpus, cfg.data)
  state = step.init_state(jax.random.key(0))
  for _ in range(2):
    state, _ = step(state, step.put_batch(next(it)))
  ck = ckpt_lib.Checkpointer(str(tmp_path), CheckpointConfig(async_save=True))
  ck.save(2, state, it.state())
  ck.wait()
  ref_state, ref_m = step(state, step.put_batch(next(it)))  # donates `state`: the checkpoint must be complete
  ref = jax.device_get((ref_state, ref_m))
  ck.close()

  step2 = build_step(cfg, make_mesh(cfg.mesh))  # a fresh compiled step, as after a restart
  ck2 = ckpt_lib.Checkpointer(str(tmp_path), CheckpointConfig())
  assert ck2.latest_step() == 2
  restored, data_state = ck2.restore(step2.abstract_state())
  ck2.close()
  it2 = data_lib.BatchIterator(corpus, cfg.data)
  it2.restore(data_state)
  assert int(restored.step) == 2 and it2.step == 2
  assert jax.tree.map(lambda a: a.sharding, restored) == step2.state_shardings
  got = jax.device_get(step2(restored, step2.put_batch(next(it2))))
  flat_ref, flat_got = jax.tree_util.tree_leaves_with_path(ref), jax.tree_util.tree_leaves_with_path(got)
  assert len(flat_ref) == len(flat_got)
  for (path, a), (_, b) in zip(flat_ref, flat_got):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_interrupted_run_resumes_exactly(tmp_path):
  """The loop itself: 2 steps, stop, rerun -> resumes at step 2 (state + data position) and the losses of
  steps 3-4 and the final params equal an uninterrupted 4-step run bit for bit."""
  cfg = tiny_config(checkpoint=dict(every=2, async_save=True))
  full = train.train_and_evaluate(cfg, str(tmp_path / "full"), build=build_on_devices)
  part = train.train_and_evaluate(cfg, str(tmp_path / "split"), build=build_on_devices, max_steps=2)
  assert part["steps"] == 2
  resumed = train.train_and_evaluate(cfg, str(tmp_path / "split"), build=build_on_devices)
  loss = lambda wd: {r["step"]: r["loss"] for r in _records(wd) if "loss" in r}  # noqa: E731
  lf, ls = loss(tmp_path / "full"), loss(tmp_path / "split")
  assert lf[3] == ls[3] and lf[4] == ls[4], (lf, ls)
  a, b = jax.device_get(full["state"].params), jax.device_get(resumed["state"].params)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  assert int(resumed["state"].step) == 4


def test_loop_runs_hooks_in_order_and_the_same_steps(tmp_path):
  """framework.train.loop with hooks: each hook sees the steps in order (a scheduled save between a step's
  after_step and the next before_step), heartbeats arrive while the first step compiles, the last step is saved,
  and the losses equal the same steps called by hand on the same batches."""
  cfg = config_lib.validate(tiny_config(), jax.device_count())
  corpus = data_lib.load_corpus(cfg.data)
  step = build_step(cfg, make_mesh(cfg.mesh))
  calls, beats = [], []
  hooks = train.Hooks(before_step=[lambda s, st: calls.append(("before", s))],
                      after_step=[lambda d, st, m: calls.append(("after", d, float(m.loss)))],
                      on_checkpoint=[lambda d, saved: calls.append(("ckpt", d, saved))],
                      on_heartbeat=[beats.append], heartbeat_s=0.01)
  saves = train.Saves(str(tmp_path), CheckpointConfig(every=2, keep=5), every=2, last=True)
  it = data_lib.BatchIterator(corpus, cfg.data, rows=step.local_rows())
  final = train.loop(step, step.init_state(jax.random.key(0)), it, 5, saves, hooks)
  saves.close()
  assert [c[:2] for c in calls] == [("before", 0), ("after", 1), ("before", 1), ("after", 2), ("ckpt", 2),
                                    ("before", 2), ("after", 3), ("before", 3), ("after", 4), ("ckpt", 4),
                                    ("before", 4), ("after", 5)]
  assert all(c[2] is True for c in calls if c[0] == "ckpt")
  assert beats and beats[0] == 0 and beats == sorted(beats)
  assert ckpt_lib.step_dirs(ckpt_lib.checkpoint_dir(str(tmp_path))) == [5, 4, 2] and int(final.step) == 5
  state, ref_it, ref = step.init_state(jax.random.key(0)), data_lib.BatchIterator(corpus, cfg.data), []
  for _ in range(5):
    state, m = step(state, step.put_batch(next(ref_it)))
    ref.append(float(m.loss))
  assert [c[2] for c in calls if c[0] == "after"] == ref


def test_weight_decay_spares_norms_and_biases_in_a_scanned_stack():
  """A scanned layer stack makes a norm's scale 2-D (layers x width): decay still goes by what the parameter is."""
  import jax.tree_util as jtu
  from framework import model as model_lib
  from framework import optim
  from framework.config import ModelConfig
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, qkv_bias=True,
                    n_experts=4, experts_per_token=2, router_bias_rate=0.01, scan_layers=True)
  m = model_lib.build(cfg)
  params = jax.eval_shape(lambda: nn.unbox(model_lib.init_params(m, jax.random.key(0))))
  decay = {jtu.keystr(p): optim.decayed(p, x) for p, x in jtu.tree_leaves_with_path(params)}
  assert decay["['layers']['attn_norm']['scale']"] is False and params["layers"]["attn_norm"]["scale"].ndim == 2
  assert decay["['layers']['attn']['bq']"] is False and decay["['layers']['moe']['router_bias']"] is False
  assert decay["['layers']['attn']['wq']"] and decay["['layers']['moe']['we_up']"] and decay["['embed']['embedding']"]
  assert decay["['final_norm']['scale']"] is False
