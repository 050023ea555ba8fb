"""Training loop: config -> compiled step -> loop (data, metrics, orbax) -> workdir.

:func:`loop` is the project's one training loop: batches in, the step called, checkpoints on a schedule, a
stop on SIGINT / SIGTERM saved at a step boundary (``framework/stop.py``). Whatever else a caller does around
the steps goes in through :class:`Hooks` (before and after a step, on a checkpoint, on a heartbeat):
:func:`train_and_evaluate` adds metrics, evaluation and a progress bar this way, and the hot-swap worker
(``resilience/worker.py``) its snapshots, step reports and liveness heartbeats.

The loop does not build the step: its caller passes ``build`` (config -> compiled step on this job's
devices; ``parallelism.step.build_on_devices``, wired up by ``experiments.run.train``), so the training
core sits below the parallelism that lays it out.

The host never waits for the device inside the loop except at log steps: metrics are device
arrays until then, so dispatch of step t+1 overlaps the compute of step t.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Callable, List, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from framework import checkpoint as ckpt_lib
from framework import config as config_lib
from framework import data as data_lib
from framework import flops as flops_lib
from framework import moe as moe_lib
from framework import observe
from framework import optim
from framework import sampling
from framework import stop as stop_lib
from framework import workdir as workdir_lib
from framework.config import Config

log = logging.getLogger("prismllm")


def _progress(total: int, start: int, enabled: bool):
  if not enabled or jax.process_index() != 0:
    return None
  return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, mininterval=1.0)


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
    ok = int(multihost_utils.broadcast_one_to_all(np.int32(err is None)))
    if not ok and err is None:
      err = workdir_lib.WorkdirError(f"--workdir {workdir} is in use by another run (process 0 could not lock it: "
                                     f"see its message); wait for it to finish or use another --workdir")
  if err is not None:
    raise err
  return lock


# ------------------------------------------------------------------------------------------- the loop

@dataclasses.dataclass
class Hooks:
  """What a caller runs around the loop's steps; each field is a list of callables, run in order.

  ``before_step(step, state)``: before step ``step`` (= steps done so far) takes its batch.
  ``after_step(done, state, metrics)``: after step ``done`` is dispatched; ``metrics`` are device arrays, so
  reading one waits for the step (the loop itself never does).
  ``on_checkpoint(done, saved)``: after the loop started the scheduled save of step ``done`` (``saved``: orbax
  took it); not called for the save of a stop or of the last step.
  ``on_heartbeat(done)``: every ``heartbeat_s`` seconds from a background thread while the loop runs, also
  while a step blocks (``done``: steps finished so far). A caller that must show it is alive before the loop
  (set-up, compilation) and after it opens :meth:`heartbeats` around all of it; the loop then starts none."""
  before_step: List[Callable[[int, Any], None]] = dataclasses.field(default_factory=list)
  after_step: List[Callable[[int, Any, Any], None]] = dataclasses.field(default_factory=list)
  on_checkpoint: List[Callable[[int, bool], None]] = dataclasses.field(default_factory=list)
  on_heartbeat: List[Callable[[Optional[int]], None]] = dataclasses.field(default_factory=list)
  heartbeat_s: float = 10.0
  done: Optional[int] = None  # steps finished, set by the loop (None before it starts)
  _beating: bool = dataclasses.field(default=False, repr=False)

  @contextlib.contextmanager
  def heartbeats(self):
    """Runs the ``on_heartbeat`` callables every ``heartbeat_s`` seconds on a daemon thread until the block
    ends (nothing when there are none, or when an enclosing block already runs them)."""
    if not self.on_heartbeat or self._beating:
      yield self
      return
    stop = threading.Event()

    def beat():
      while not stop.wait(self.heartbeat_s):
        for fn in self.on_heartbeat:
          fn(self.done)
    thread = threading.Thread(target=beat, name="prismllm-heartbeat", daemon=True)
    self._beating = True
    thread.start()
    try:
      yield self
    finally:
      stop.set()
      thread.join(timeout=self.heartbeat_s)
      self._beating = False


class Saves:
  """Where and when the loop saves: every ``every`` steps (0: never on a schedule), the last step when ``last``,
  and the step a stop ends at. The orbax manager is ``ckpt`` when the caller opened one (to restore from it),
  else it opens at the first save (its start-up is a collective: seconds on a busy host)."""

  def __init__(self, workdir: str, cfg: config_lib.CheckpointConfig, every: int, last: bool,
               ckpt: Optional[ckpt_lib.Checkpointer] = None):
    self.workdir, self.cfg, self.every, self.last, self.ckpt = workdir, cfg, every, last, ckpt
    self.last_saved: Optional[int] = None

  def open(self) -> ckpt_lib.Checkpointer:
    self.ckpt = self.ckpt or ckpt_lib.Checkpointer(self.workdir, self.cfg)
    return self.ckpt

  def due(self, done: int) -> bool:
    return self.every > 0 and done % self.every == 0

  def save(self, done: int, state, data_state: dict, force: bool = False) -> bool:
    saved = self.open().save(done, state, data_state, force=force)
    self.last_saved = done
    return saved

  def last_good(self) -> str:
    """Names the newest complete checkpoint (for the line a second signal prints)."""
    d = ckpt_lib.checkpoint_dir(self.workdir)
    steps = ckpt_lib.step_dirs(d)
    return f"the last complete checkpoint, step {steps[0]} in {d}, is intact" if steps \
        else "no complete checkpoint was written yet"

  def close(self):
    if self.ckpt is not None:
      self.ckpt.close()


def loop(step_obj, state, batches, total: int, saves: Saves,
         hooks: Optional[Hooks] = None):
  """Runs steps ``state.step`` .. ``total`` - 1 and returns the final state (the last step saved when
  ``saves.last``, every save finished).

  ``step_obj``: ``put_batch(host rows) -> batch`` and ``step_obj(state, batch) -> (state, metrics)`` (a
  ``parallelism.compiled.CompiledStep``, or any executable behind the same two calls); ``batches``: this
  process's host rows, positioned at the state's step (``data.iterator``: ``next()``, ``state()``). SIGINT / SIGTERM stop after the current step with that
  step saved (all processes agree on it) and raise :class:`framework.stop.Stopped`."""
  hooks = hooks or Hooks()
  start = int(jax.device_get(state.step))
  hooks.done = start
  stopper = stop_lib.StopOnSignal(saves.last_good)

  def stop_if_asked(done: int, state):
    """After step ``done``: on a signal (all processes agree on the step), save it, wait, raise Stopped."""
    if not stopper.should_stop(done):
      return
    if done == start:  # no step taken since the last checkpoint (or the start)
      raise stop_lib.Stopped(stopper.signum, done, None, note=" (no step was taken, nothing new to save)")
    ckpt = saves.open()
    if done not in (ckpt.latest_step(), saves.last_saved):
      saves.save(done, state, batches.state(), force=True)
    ckpt.wait()
    raise stop_lib.Stopped(stopper.signum, done, os.path.join(ckpt.dir, str(done)))

  with stopper, hooks.heartbeats():
    stop_if_asked(start, state)  # a signal during set-up or compilation
    for step in range(start, total):
      for fn in hooks.before_step:
        fn(step, state)
      batch = step_obj.put_batch(next(batches))
      state, metrics = step_obj(state, batch)
      done = hooks.done = step + 1
      for fn in hooks.after_step:
        fn(done, state, metrics)
      if saves.due(done):
        saved = saves.save(done, state, batches.state())
        for fn in hooks.on_checkpoint:
          fn(done, saved)
      stop_if_asked(done, state)
    if saves.last and total > 0 and (saves.ckpt is None or saves.ckpt.latest_step() != total):
      saves.save(total, state, batches.state(), force=True)
    if saves.ckpt is not None:
      saves.ckpt.wait()  # inside the signal handlers: a second signal still exits at once
  return state


# ------------------------------------------------------------------------------ train_and_evaluate's run

class _Metrics:
  """train_and_evaluate's hooks: metrics.jsonl (and its TensorBoard scalars, framework/observe.py), the progress
  bar and evaluation. Step time is measured between log steps, restarted after an evaluation or a checkpoint
  (they are not training steps); ``lr`` is the schedule's rate of the logged step's update."""

  def __init__(self, cfg: Config, step_obj, corpus, workdir: str, start: int, total: int, is_main: bool):
    self.cfg, self.step_obj, self.eval_data, self.total = cfg, step_obj, corpus.eval, total
    self.f = open(os.path.join(workdir, "metrics.jsonl"), "a") if is_main else None
    self.scalars = observe.Scalars(workdir) if is_main and cfg.train.tensorboard else None
    self.lr = optim.schedule(cfg.optim, cfg.train.steps)
    self.bar = _progress(total, start, cfg.train.progress)
    self.tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    self.fpt = flops_lib.train_flops_per_token(cfg.model, cfg.data.seq_len)
    self.peak, self.peak_src = flops_lib.peak_flops(cfg.train.peak_flops)
    self.history, self.first_loss, self.last_t, self.last_step, self.m = [], None, None, start, None

  def hooks(self) -> Hooks:
    return Hooks(after_step=[self.after_step], on_checkpoint=[lambda done, saved: self.restart_clock(done)])

  def write(self, rec: dict):
    if self.f:
      self.f.write(json.dumps(rec) + "\n")
      self.f.flush()
    if self.scalars:
      self.scalars.write(rec)

  def restart_clock(self, done: int):
    jax.block_until_ready(self.m.loss)
    self.last_t, self.last_step = time.perf_counter(), done

  def after_step(self, done: int, state, m):
    self.m = m
    if self.bar is not None:
      self.bar.update(1)
    if self.last_t is None:  # first step includes compilation: time from its end
      self.restart_clock(done)
      self.first_loss = float(m.loss)
      self.write({"step": done, "loss": self.first_loss, "compile_step": True})
      return
    if done % self.cfg.train.log_every == 0 or done == self.total:
      loss = float(m.loss)  # blocks: the only host sync in the loop
      now = time.perf_counter()
      dt = (now - self.last_t) / max(done - self.last_step, 1)
      self.last_t, self.last_step = now, done
      tps = self.tokens_per_step / dt
      rec = {"step": done, "loss": loss, "grad_norm": float(m.grad_norm), "lr": float(self.lr(done - 1)),
             "step_time_s": dt, "tokens_per_s": tps, "mfu": self.fpt * tps / self.peak}
      if m.expert_load is not None:  # assignments per layer and expert of this step (predict --expert-load reads it)
        load = np.asarray(m.expert_load)
        rec["expert_load"] = load.round().astype(int).tolist()
        rec["expert_imbalance"] = moe_lib.imbalance(load, self.cfg.mesh.expert)
      self.history.append(rec)
      self.write(rec)
      if self.bar is not None:
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", mfu=f"{rec['mfu']:.1%}")
    if self.cfg.train.eval_every and done % self.cfg.train.eval_every == 0:
      ev = evaluate(self.step_obj, state.params, self.eval_data, self.cfg, self.cfg.train.eval_batches)
      self.write({"step": done, "eval_loss": ev})
      if self.bar is not None:
        self.bar.write(f"step {done}: eval loss {ev:.3f} nats/{'byte' if self.cfg.data.tokenizer == 'bytes' else 'token'}")
      self.restart_clock(done)

  def close(self):
    if self.bar is not None:
      self.bar.close()
    if self.f:
      self.f.close()
    if self.scalars:
      self.scalars.close()


def _train(cfg: Config, workdir: str, build, max_steps: Optional[int]) -> dict:
  is_main = jax.process_index() == 0
  corpus = data_lib.load(cfg)  # a bad corpus or tokenizer fails before compiling
  step_obj = build(cfg)
  ckpt = ckpt_lib.Checkpointer(workdir, cfg.checkpoint) if cfg.checkpoint.every > 0 else None
  saves = Saves(workdir, cfg.checkpoint, cfg.checkpoint.every, last=ckpt is not None, ckpt=ckpt)

  data_state = None
  if ckpt is not None and cfg.checkpoint.restore and ckpt.latest_step() is not None:
    state, data_state = ckpt.restore(step_obj.abstract_state())  # a foreign checkpoint stops here: nothing written
    log.info("resumed from step %d", int(state.step))
  else:
    if ckpt is not None and ckpt.incomplete and is_main:
      log.warning("no complete checkpoint in %s: training starts at step 0", ckpt.dir)
    state = step_obj.init_state(jax.random.key(cfg.train.seed))
  start = int(jax.device_get(state.step))
  it = data_lib.iterator(corpus, cfg.data, step=start, rows=step_obj.local_rows())
  it.restore(data_state)
  # Everything is checked: from here on the workdir changes.
  if is_main:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config_lib.to_dict(cfg), f, indent=1, default=str)

  total = cfg.train.steps if max_steps is None else min(cfg.train.steps, start + max_steps)
  metrics = _Metrics(cfg, step_obj, corpus, workdir, start, total, is_main)
  profile = observe.Profile(cfg.train.profile_steps, workdir, start, total)
  hooks = metrics.hooks()
  hooks.before_step.append(profile.before_step)
  hooks.after_step.append(profile.after_step)
  if is_main:
    log.info("model %.2fM params | mesh %s | form %s | %d devices, %d processes | peak %.3g FLOP/s (%s)",
             cfg.model.n_params() / 1e6, cfg.mesh.sizes(), cfg.mesh.form, jax.device_count(),
             jax.process_count(), metrics.peak, metrics.peak_src)
  try:
    state = loop(step_obj, state, it, total, saves, hooks)
  finally:
    profile.close()
    metrics.close()
    saves.close()

  history, first_loss = metrics.history, metrics.first_loss
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
                                  cfg.train.sample_temperature, seed=cfg.train.seed, tok=corpus.tokenizer)
    summary["sample"] = text
    if is_main:
      with open(os.path.join(workdir, "sample.txt"), "w") as f:
        f.write(text)
  summary["state"] = state
  return summary
