"""Stopping on SIGINT / SIGTERM at a step boundary, so that a user's Ctrl-C and a scheduler's preemption end in a
checkpoint instead of a traceback.

One process: the first signal sets a flag that the training loop reads after every step; the loop then saves
a checkpoint at that step, waits for it, and raises :class:`Stopped` (exit 130 for SIGINT, 0 for SIGTERM).
Several processes (``jax.distributed``): every process must stop after the same step, or the save's collectives
would wait for a peer that has left. JAX's preemption sync point chooses that step: the notifier that
``jax.distributed.initialize`` installs catches SIGTERM in any process and the processes agree on the first
step all of them can reach (``multihost_utils.reached_preemption_sync_point``). SIGINT is handed to that
notifier as a SIGTERM to this process, so Ctrl-C goes the same way. A Python SIGTERM handler is never
installed then: it would replace the notifier's.
A second signal exits at once (``os._exit``): a save still being written stays an orbax temp folder that the
next run removes, and the last complete checkpoint is untouched. A signal the process ignores (``SIG_IGN``
inherited from its parent, as hot-swap workers ignore the terminal's Ctrl-C that their launcher turns into a stop)
stays ignored.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 0}  # SIGTERM is a scheduler's request: stopping is success


class Stopped(Exception):
  """Training stopped on a signal after ``step``; ``checkpoint`` is where that step is saved (None: nothing to
  save). ``str()`` is the one line a user reads."""

  def __init__(self, signum: int, step: int, checkpoint: Optional[str], note: str = ""):
    self.signum, self.step, self.checkpoint = signum, step, checkpoint
    name = signal.Signals(signum).name
    if checkpoint:
      msg = (f"stopped by {name} after step {step}; checkpoint saved in {checkpoint}. To resume from step {step}, "
             f"run the same command again (same --config and --workdir)")
    else:
      msg = f"stopped by {name} before step {step + 1}{note}; run the same command again to resume"
    super().__init__(msg)

  @property
  def exit_code(self) -> int:
    return SIGNAL_EXIT.get(self.signum, 128 + self.signum)


def _multi_process() -> bool:
  import jax  # noqa: PLC0415 (jax-free at import: experiments/run.py imports this module before jax)
  return jax.process_count() > 1


def _sync_manager():
  from jax._src import distributed  # noqa: PLC0415 (jax-free at import: experiments/run.py imports this module before jax)
  return distributed.global_state.preemption_sync_manager


class StopOnSignal:
  """Context manager for a training loop: ``should_stop(step)`` after each step; ``signum`` says which signal.

  ``on_second(signum)`` runs (then ``os._exit``) when a second signal arrives before the loop has stopped."""

  def __init__(self, last_good: Optional[callable] = None):
    self.signum: Optional[int] = None
    self._last_good = last_good  # () -> str naming the last complete checkpoint, for the second-signal line
    self._old = {}
    self._multi = False

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self  # handlers can only be set from the main thread (e.g. a notebook's worker thread: no change)
    self._multi = _multi_process() and _sync_manager() is not None
    for sig in (signal.SIGINT,) if self._multi else (signal.SIGINT, signal.SIGTERM):
      if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored: the parent decided (e.g. Ctrl-C is for another)
        self._old[sig] = signal.signal(sig, self._on_signal)
    return self

  def __exit__(self, *exc):
    for sig, h in self._old.items():
      signal.signal(sig, h)
    self._old = {}

  def _on_signal(self, signum, _frame):
    if self.signum is not None:
      where = self._last_good() if self._last_good else ""
      print(f"second {signal.Signals(signum).name}: exiting at once without saving; {where}", file=sys.stderr,
            flush=True)
      os._exit(128 + signum)
    self.signum = signum
    print(f"{signal.Signals(signum).name} received: saving a checkpoint after this step (send it again to exit at "
          f"once without saving)", file=sys.stderr, flush=True)
    if self._multi and signum != signal.SIGTERM:
      os.kill(os.getpid(), signal.SIGTERM)  # to jax's preemption notifier: every process agrees on the step

  def should_stop(self, step: int) -> bool:
    if not self._multi:
      return self.signum is not None
    from jax.experimental import multihost_utils  # noqa: PLC0415 (jax-free at import: experiments/run.py imports this module before jax)
    if multihost_utils.reached_preemption_sync_point(step):
      if self.signum is None:
        self.signum = signal.SIGTERM  # the notice came from another process (or a SIGTERM the notifier caught)
      if threading.current_thread() is threading.main_thread():  # the notice is in: a second SIGTERM exits at once
        self._old.setdefault(signal.SIGTERM, signal.signal(signal.SIGTERM, self._on_signal))
      return True
    return False
