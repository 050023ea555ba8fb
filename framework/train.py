"""Training loop: config -> compiled step -> loop (data, metrics, orbax) -> workdir.

The loop does not build the step: its caller passes ``build`` (config -> compiled step on this job's
devices; ``parallelism.step.build_on_devices``, wired up by ``experiments.run.train``), so the training
core sits below the parallelism that lays it out.

The host never waits for the device inside the loop except at log steps: metrics are device
arrays until then, so dispatch of step t+1 overlaps the compute of step t.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from framework import checkpoint as ckpt_lib
from framework import config as config_lib
from framework import data as data_lib
from framework import flops as flops_lib
from framework import sampling
from framework import stop as stop_lib
from framework import workdir as workdir_lib
from framework.config import Config

log = logging.getLogger("prismllm")


def _progress(total: int, start: int, enabled: bool):
  if not enabled or jax.process_index() != 0:
    return None
  from tqdm import tqdm  # noqa: PLC0415
  return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, mininterval=1.0)


def _last_good(ckpt, workdir: str) -> str:
  """Names the newest complete checkpoint (for the line a second signal prints)."""
  steps = ckpt_lib.step_dirs(ckpt_lib.checkpoint_dir(workdir))
  return f"the last complete checkpoint, step {steps[0]} in {ckpt_lib.checkpoint_dir(workdir)}, is intact" if steps \
      else "no complete checkpoint was written yet"


def evaluate(step_obj, params, eval_data: np.ndarray, cfg: Config, n_batches: int) -> float:
  """Mean loss over fixed eval windows (seed offset 1 keeps them apart from training draws)."""
  fn = step_obj.eval_fn
  losses = []
  for i in range(n_batches):
    b = step_obj.put_batch(data_lib.batch_at(eval_data, i, cfg.data, seed_offset=1_000_003,
                                             rows=step_obj.local_rows()))
    with step_obj.context():
      losses.append(fn(params, b))
  return float(np.mean(jax.device_get(losses)))


def train_and_evaluate(cfg: Config, workdir: str, *, build: Callable[[Config], Any],
                       max_steps: Optional[int] = None) -> dict:
  """Trains ``cfg`` in ``workdir`` (resuming if a checkpoint exists). Returns a summary dict.

  ``build``: the validated config -> its compiled step (``parallelism.compiled.CompiledStep``'s interface:
  ``init_state``, ``abstract_state``, ``put_batch``, ``local_rows``, ``context``, ``eval_fn``, ``model``,
  and ``step(state, batch) -> (state, metrics)``).

  Nothing in the workdir changes before the config, the corpus and the checkpoint (if any) are checked and
  the workdir is locked for this run (``framework.workdir``). SIGINT / SIGTERM stop after the current step
  with a checkpoint there and raise :class:`framework.stop.Stopped` (``framework/stop.py``)."""
  cfg = config_lib.validate(cfg, jax.device_count(), jax.process_count())
  workdir = workdir_lib.check_path(workdir)
  lock = _lock(workdir)
  try:
    return _train(cfg, workdir, build, max_steps)
  finally:
    if lock is not None:
      lock.release()


def _lock(workdir: str):
  """Process 0 locks the workdir (shared storage); every process learns whether it could."""
  lock, err = None, None
  if jax.process_index() == 0:
    try:
      lock = workdir_lib.lock(workdir, "training run")
    except workdir_lib.WorkdirError as e:
      err = e
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # noqa: PLC0415
    ok = int(multihost_utils.broadcast_one_to_all(np.int32(err is None)))
    if not ok and err is None:
      err = workdir_lib.WorkdirError(f"--workdir {workdir} is in use by another run (process 0 could not lock it: "
                                     f"see its message); wait for it to finish or use another --workdir")
  if err is not None:
    raise err
  return lock


def _train(cfg: Config, workdir: str, build, max_steps: Optional[int]) -> dict:
  is_main = jax.process_index() == 0
  corpus = data_lib.split(data_lib.load_corpus(cfg.data), cfg.data)  # bad corpus fails before compiling
  step_obj = build(cfg)
  ckpt = ckpt_lib.Checkpointer(workdir, cfg.checkpoint) if cfg.checkpoint.every > 0 else None

  data_state = None
  if ckpt is not None and cfg.checkpoint.restore and ckpt.latest_step() is not None:
    state, data_state = ckpt.restore(step_obj.abstract_state())  # a foreign checkpoint stops here: nothing written
    log.info("resumed from step %d", int(state.step))
  else:
    if ckpt is not None and ckpt.incomplete and is_main:
      log.warning("no complete checkpoint in %s: training starts at step 0", ckpt.dir)
    state = step_obj.init_state(jax.random.key(cfg.train.seed))
  start = int(jax.device_get(state.step))
  it = data_lib.BatchIterator(corpus.train, cfg.data, step=start, rows=step_obj.local_rows())
  it.restore(data_state)
  # Everything is checked: from here on the workdir changes.
  if is_main:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config_lib.to_dict(cfg), f, indent=1, default=str)

  total = cfg.train.steps if max_steps is None else min(cfg.train.steps, start + max_steps)
  tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
  fpt = flops_lib.train_flops_per_token(cfg.model, cfg.data.seq_len)
  peak, peak_src = flops_lib.peak_flops(cfg.train.peak_flops)
  if is_main:
    log.info("model %.2fM params | mesh %s | form %s | %d devices, %d processes | peak %.3g FLOP/s (%s)",
             cfg.model.n_params() / 1e6, cfg.mesh.sizes(), cfg.mesh.form, jax.device_count(),
             jax.process_count(), peak, peak_src)
  metrics_f = open(os.path.join(workdir, "metrics.jsonl"), "a") if is_main else None
  bar = _progress(total, start, cfg.train.progress)
  history, last_t, last_step = [], None, start
  first_loss = None
  stopper = stop_lib.StopOnSignal(lambda: _last_good(ckpt, workdir))
  last_saved = None

  def stop_if_asked(done: int, state):
    """After step ``done``: on a signal (all processes agree on the step), save it, wait, raise Stopped."""
    nonlocal ckpt
    if not stopper.should_stop(done):
      return
    if done == start:  # no step taken since the last checkpoint (or the start)
      raise stop_lib.Stopped(stopper.signum, done, None, note=" (no step was taken, nothing new to save)")
    ckpt = ckpt or ckpt_lib.Checkpointer(workdir, cfg.checkpoint)
    if done not in (ckpt.latest_step(), last_saved):
      ckpt.save(done, state, it.state(), force=True)
    ckpt.wait()
    raise stop_lib.Stopped(stopper.signum, done, os.path.join(ckpt.dir, str(done)))

  try:
    with stopper:
      stop_if_asked(start, state)  # a signal during set-up or compilation
      for step in range(start, total):
        batch = step_obj.put_batch(next(it))
        state, m = step_obj(state, batch)
        done = step + 1
        if bar is not None:
          bar.update(1)
        if last_t is None:  # first step includes compilation: time from its end
          jax.block_until_ready(m.loss)
          last_t, last_step = time.perf_counter(), done
          first_loss = float(m.loss)
          if metrics_f:
            metrics_f.write(json.dumps({"step": done, "loss": first_loss, "compile_step": True}) + "\n")
            metrics_f.flush()
          stop_if_asked(done, state)
          continue
        if done % cfg.train.log_every == 0 or done == total:
          loss = float(m.loss)  # blocks: the only host sync in the loop
          now = time.perf_counter()
          dt = (now - last_t) / max(done - last_step, 1)
          last_t, last_step = now, done
          tps = tokens_per_step / dt
          rec = {"step": done, "loss": loss, "grad_norm": float(m.grad_norm), "step_time_s": dt,
                 "tokens_per_s": tps, "mfu": fpt * tps / peak}
          history.append(rec)
          if metrics_f:
            metrics_f.write(json.dumps(rec) + "\n")
            metrics_f.flush()
          if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{rec['mfu']:.1%}")
        if cfg.train.eval_every and done % cfg.train.eval_every == 0:
          ev = evaluate(step_obj, state.params, corpus.eval, cfg, cfg.train.eval_batches)
          if metrics_f:
            metrics_f.write(json.dumps({"step": done, "eval_loss": ev}) + "\n")
            metrics_f.flush()
          if bar is not None:
            bar.write(f"step {done}: eval loss {ev:.3f} nats/byte")
        if ckpt is not None and done % cfg.checkpoint.every == 0:
          ckpt.save(done, state, it.state())
          last_saved = done
        if (cfg.train.eval_every and done % cfg.train.eval_every == 0) or (
            ckpt is not None and done % cfg.checkpoint.every == 0):
          # Eval and the checkpoint's device->host copy are not training steps: restart the
          # step-time window after them so step_time_s / tokens_per_s / mfu measure steps only.
          jax.block_until_ready(m.loss)
          last_t, last_step = time.perf_counter(), done
        stop_if_asked(done, state)
      if ckpt is not None and total > start and ckpt.latest_step() != total:
        ckpt.save(total, state, it.state(), force=True)
      if ckpt is not None:
        ckpt.wait()  # inside the signal handlers: a second signal still exits at once
  finally:
    if bar is not None:
      bar.close()
    if ckpt is not None:
      ckpt.close()
    if metrics_f:
      metrics_f.close()

  summary = {"workdir": workdir, "steps": total, "first_loss": first_loss,
             "final_loss": history[-1]["loss"] if history else first_loss,
             "flop_convention": flops_lib.CONVENTION}
  if history:
    tail = history[len(history) // 2:]
    summary.update(tokens_per_s=float(np.median([h["tokens_per_s"] for h in tail])),
                   mfu=float(np.median([h["mfu"] for h in tail])))
  if cfg.train.sample_tokens > 0:
    with step_obj.context():
      text = sampling.sample_text(state.params, step_obj.model, cfg.train.sample_prompt, cfg.train.sample_tokens,
                                  cfg.train.sample_temperature, seed=cfg.train.seed)
    summary["sample"] = text
    if is_main:
      with open(os.path.join(workdir, "sample.txt"), "w") as f:
        f.write(text)
  summary["state"] = state
  return summary
