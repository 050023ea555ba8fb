"""What a training run writes to be looked at besides metrics.jsonl: TensorBoard scalars and a profiler trace.

:class:`Scalars` mirrors every metrics.jsonl record into TensorBoard event files in ``<workdir>/tensorboard/``
(``train.tensorboard``; process 0 only, like metrics.jsonl): the same keys as scalar tags at the same steps.
The writer is ``tensorboardX`` (protobuf and numpy, no TensorFlow). ``tensorboard --logdir <workdir>`` shows them.

:class:`Profile` captures a ``jax.profiler`` trace of the steps ``train.profile_steps = (START, COUNT)`` names
(steps START .. START+COUNT-1, counted from 0 like the step a checkpoint resumes at) into ``<workdir>/profile/``:
``plugins/profile/<time>/<host>.xplane.pb`` (TensorBoard's profile plugin / XProf) and
``<host>.trace.json.gz`` (https://ui.perfetto.dev or chrome://tracing). Every process traces its own devices;
the host name keeps their files apart. Both are hooks of the one training loop (``framework.train.Hooks``).
"""
from __future__ import annotations

import logging
import os
import jax

log = logging.getLogger("prismllm")


def tensorboard_dir(workdir: str) -> str:
  return os.path.join(workdir, "tensorboard")


def profile_dir(workdir: str) -> str:
  return os.path.join(workdir, "profile")


class Scalars:
  """TensorBoard scalars of metrics.jsonl records: every numeric field but ``step`` becomes a tag of that name."""

  def __init__(self, workdir: str):
    from tensorboardX import SummaryWriter  # noqa: PLC0415 (heavy: tensorboardX, ~0.6 s; only train.tensorboard)
    self.writer = SummaryWriter(tensorboard_dir(workdir), flush_secs=10)

  def write(self, rec: dict):
    step = int(rec["step"])
    for k, v in rec.items():
      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
        self.writer.add_scalar(k, float(v), step)

  def close(self):
    self.writer.close()


class Profile:
  """A ``jax.profiler`` trace of steps ``start`` .. ``start + count - 1`` of the loop (``before_step`` starts
  it, ``after_step`` waits for the last traced step's device work and stops it; ``close`` stops a trace a
  stop or an error left open)."""

  def __init__(self, steps: tuple, workdir: str, first: int, total: int):
    self.start, self.count = (int(steps[0]), int(steps[1])) if steps else (-1, 0)
    self.dir, self.active, self.path = profile_dir(workdir), False, None
    if steps and not first <= self.start < total:
      log.warning("train.profile_steps=%s: step %d is not among the steps this run takes (%d .. %d); no trace",
                  tuple(steps), self.start, first, total - 1)

  def before_step(self, step: int, state):
    if step == self.start and not self.active:
      os.makedirs(self.dir, exist_ok=True)
      jax.profiler.start_trace(self.dir)
      self.active = True

  def after_step(self, done: int, state, metrics):
    if self.active and done == self.start + self.count:
      jax.block_until_ready(metrics)  # the traced steps' device work ends inside the trace
      self.stop()

  def stop(self):
    jax.profiler.stop_trace()
    self.active, self.path = False, self.dir
    log.info("profile of steps %d..%d in %s", self.start, self.start + self.count - 1, self.dir)

  def close(self):
    if self.active:
      self.stop()
