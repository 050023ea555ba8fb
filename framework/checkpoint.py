"""Orbax checkpoints of {train state, data-iterator state}, async by default, verified on restore.

The workdir path is made absolute (orbax refuses relative paths). Restoring needs the abstract
state with its shardings, so the same checkpoint restores into any mesh layout.

Integrity: orbax restores a flipped bit in an array file silently (zstd chunks carry no checksum),
so every save also stores a layout-independent checksum of the state (per leaf, the sum and the
position-weighted sum of its 32-bit words, modulo 2^32: integer sums do not depend on how the array
is sharded or reduced) in the data item, and a restore recomputes and compares it.

What a restore does with a bad workdir (every case ends in a restore or in one line naming the fix):
* a step written by another model or state layout (tree paths, shapes or dtypes differ from the
  abstract state): ``CheckpointError(kind='foreign')`` naming the first difference; never a
  fallback to an older step (the same mismatch, or worse, another run's state);
* a corrupt or partial step (unreadable metadata, missing items, truncated or flipped data, checksum
  mismatch): the latest step that restores and verifies is used, and every newer bad step is moved
  aside to ``<workdir>/checkpoints_bad/`` (kept, never deleted; orbax would otherwise skip saving
  those step numbers again) with a ``WHY.txt``; the log says which and why;
* nothing restorable: ``CheckpointError(kind='corrupt')`` listing each step's problem.
Incomplete saves (a process killed mid-save) stay in orbax's ``*.orbax-checkpoint-tmp-*`` folders,
which are never listed as steps and are removed (with a log line) when the next manager starts.
A save that finds the disk full (ENOSPC / EDQUOT, also as tensorstore's RESOURCE_EXHAUSTED inside orbax's
error) is ``CheckpointError(kind='io')`` naming the step and the fix; its partial folder is removed at once
and the complete steps are kept (orbax deletes old steps only after a successful save).

This module imports orbax, jax and numpy (which starts a thread) only inside functions: the step listing,
quick checks and the quarantine are plain file operations a jax-free controller (resilience/) can use, and
experiments/run.py imports its error type before it sets the allocator and XLA flags and imports jax quietly.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from typing import Any, List, Optional

from framework.config import CheckpointConfig

log = logging.getLogger("prismllm")
INTEGRITY_KEY = "_prismllm_integrity"
BAD_DIR = "checkpoints_bad"


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used; the message names the fix. ``kind``: foreign | corrupt | io."""

  def __init__(self, msg: str, kind: str = "corrupt", step: Optional[int] = None):
    super().__init__(msg)
    self.kind, self.step = kind, step


# ------------------------------------------------------------------------------ file-level (no jax)

def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def step_dirs(ckpt_dir: str) -> List[int]:
  """Finalized step folders (orbax renames a save's tmp folder to the bare step number when done), newest first."""
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted((int(x) for x in os.listdir(ckpt_dir) if x.isdigit() and os.path.isdir(os.path.join(ckpt_dir, x))),
                reverse=True)


def quick_check(ckpt_dir: str, step: int) -> Optional[str]:
  """Structural problems of one step folder that need no jax (None = looks complete)."""
  d = os.path.join(ckpt_dir, str(step))
  if not os.path.isdir(d):
    return "missing"
  missing = [x for x in ("state", "data", "state/_METADATA", "state/manifest.ocdbt")
             if not os.path.exists(os.path.join(d, x))]
  if missing:
    return f"not a complete orbax checkpoint (no {', '.join(missing)})"
  for meta in ("state/_METADATA", "_CHECKPOINT_METADATA"):
    p = os.path.join(d, meta)
    if os.path.exists(p):
      try:
        with open(p) as f:
          json.load(f)
      except (OSError, ValueError) as e:
        return f"{meta} is unreadable ({type(e).__name__})"
  return None


def latest_usable_step(ckpt_dir: str) -> Optional[int]:
  """Newest step that passes :func:`quick_check` (the deep check happens when it is restored)."""
  for s in step_dirs(ckpt_dir):
    if quick_check(ckpt_dir, s) is None:
      return s
  return None


def quarantine(ckpt_dir: str, step: int, why: str) -> Optional[str]:
  """Moves a bad step folder to ``<workdir>/checkpoints_bad/<step>[-n]`` with WHY.txt; returns the new path."""
  src = os.path.join(ckpt_dir, str(step))
  if not os.path.isdir(src):
    return None
  bad = os.path.join(os.path.dirname(ckpt_dir), BAD_DIR)
  os.makedirs(bad, exist_ok=True)
  dst, n = os.path.join(bad, str(step)), 1
  while os.path.exists(dst):
    dst, n = os.path.join(bad, f"{step}-{n}"), n + 1
  shutil.move(src, dst)
  with open(os.path.join(dst, "WHY.txt"), "w") as f:
    f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} moved out of {ckpt_dir}: {why}\n")
  return dst


# ------------------------------------------------------------------------------ integrity (jax)

def _words(x):
  import jax  # noqa: PLC0415 (jax-free at import: see the module docstring)
  import jax.numpy as jnp  # noqa: PLC0415 (jax-free at import: see the module docstring)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  size = x.dtype.itemsize
  if size in (1, 2):
    return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8-byte types gain a trailing axis of 2 words


def _sums(x):
  import jax.numpy as jnp  # noqa: PLC0415 (jax-free at import: see the module docstring)
  w = _words(x).reshape(-1)
  pos = jnp.arange(w.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
  return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * pos, dtype=jnp.uint32)])


_CHECKSUM_FN = None


def _checksum_fn():
  """One jitted function for the process: jit caches its programs per tree structure / shapes / shardings, so
  a save after the first reuses the compiled checksum (a fresh lambda per call would retrace and recompile)."""
  global _CHECKSUM_FN
  if _CHECKSUM_FN is None:
    import jax  # noqa: PLC0415 (jax-free at import: see the module docstring)
    _CHECKSUM_FN = jax.jit(lambda ls: [_sums(x) for x in ls])
  return _CHECKSUM_FN


def state_checksum(state: Any) -> List[int]:
  """Per leaf [sum, weighted sum] of its 32-bit words mod 2^32: the same for any sharding of the same values."""
  import jax  # noqa: PLC0415 (jax-free at import: see the module docstring)
  import numpy as np  # noqa: PLC0415 (numpy-free at import: see the module docstring)
  leaves = jax.tree.leaves(state)
  groups = {}  # one program per device set (a jit cannot mix arrays committed to different devices)
  for i, x in enumerate(leaves):
    devs = tuple(sorted(d.id for d in x.sharding.device_set)) if isinstance(x, jax.Array) and x.committed else ()
    groups.setdefault(devs, []).append(i)
  sums = [None] * len(leaves)
  for idx in groups.values():
    out = _checksum_fn()([leaves[i] for i in idx])
    for i, o in zip(idx, out):
      a = o if o.is_fully_addressable else o.addressable_data(0)
      sums[i] = [int(v) for v in np.asarray(a)]
  return [v for s in sums for v in s]


def _tree_signature(tree) -> dict:
  """{'path': (shape, dtype)} of an abstract state or orbax metadata tree."""
  import jax  # noqa: PLC0415 (jax-free at import: see the module docstring)
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    out[key] = (tuple(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", "?")))
  return out


_FILTER_INSTALLED = False


def _orbax_noise(u) -> bool:
  """Leftovers of a failed orbax read or write: its coroutines, and tensorstore callbacks into the closed event loop."""
  mod = getattr(getattr(u.object, "cr_code", None), "co_filename", "") or ""
  return "orbax" in mod or (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed")


def _from_orbax(exc) -> bool:
  tb = getattr(exc, "__traceback__", None)
  while tb is not None:
    if "orbax" in tb.tb_frame.f_code.co_filename:
      return True
    tb = tb.tb_next
  return False


def _install_noise_filters():
  """A failed orbax read or write leaves coroutines, tensorstore callbacks and its writer thread's exception,
  which Python reports later as tracebacks ('Exception ignored ...', 'Exception in thread ...'); the failure
  itself reaches the caller (restore, ``save`` / ``wait`` of the next step) and is reported by us in one line.
  Those leftovers (and only they) are logged at debug level instead, once a Checkpointer exists."""
  global _FILTER_INSTALLED
  if _FILTER_INSTALLED:
    return
  _FILTER_INSTALLED = True
  prev, prev_thread = sys.unraisablehook, threading.excepthook

  def unraisable(u):
    if _orbax_noise(u):
      with contextlib.suppress(Exception):
        log.debug("orbax leftover: %r", u.exc_value)
      return
    prev(u)

  def thread_hook(a):
    closed_loop = isinstance(a.exc_value, RuntimeError) and str(a.exc_value) == "Event loop is closed"
    if _from_orbax(a.exc_value) or closed_loop:
      with contextlib.suppress(Exception):
        log.debug("orbax thread %s: %r", getattr(a.thread, "name", "?"), a.exc_value)
      return
    prev_thread(a)
  sys.unraisablehook, threading.excepthook = unraisable, thread_hook
  logging.getLogger("absl").addFilter(_DiskFullLogFilter())  # orbax logs each failed writer thread's traceback
  logging.getLogger("asyncio").addFilter(_OrbaxTaskLogFilter())  # its read tasks, garbage-collected after a failure
  warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning,
                          module=r"(orbax|framework\.checkpoint|asyncio).*")


class _DiskFullLogFilter(logging.Filter):
  """Drops orbax's error records of a write that found the disk full (the caller reports it in one line)."""

  def filter(self, record) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and disk_full(exc))


class _OrbaxTaskLogFilter(logging.Filter):
  """Drops asyncio's 'Task exception was never retrieved' records for orbax's read / write tasks: when one shard
  read fails, the sibling tasks' failures are never awaited and asyncio logs each with its traceback whenever the
  garbage collector frees it (the first failure reaches the caller, which reports it in one line)."""

  def filter(self, record) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and _from_orbax(exc))


@contextlib.contextmanager
def _quiet_orbax_failures():
  """Around an orbax read that may fail: the noise filters, then collect its leftovers now."""
  _install_noise_filters()
  try:
    yield
  finally:
    gc.collect()


def disk_full(exc: BaseException) -> bool:
  """True if ``exc`` (or its cause) is a write that found no space: ENOSPC / EDQUOT, also as tensorstore's
  RESOURCE_EXHAUSTED text inside orbax's ValueError."""
  seen = 0
  while exc is not None and seen < 8:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    text = str(exc)
    if "No space left on device" in text or "Disk quota exceeded" in text or "os_error_code='28'" in text:
      return True
    exc, seen = exc.__cause__ or exc.__context__, seen + 1
  return False


def partial_saves(ckpt_dir: str) -> List[str]:
  """Folders of saves that never finished (orbax's ``<step>.orbax-checkpoint-tmp*``)."""
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(os.path.join(ckpt_dir, x) for x in os.listdir(ckpt_dir) if ".orbax-checkpoint-tmp" in x)


def remove_partial_saves(ckpt_dir: str) -> List[str]:
  """Removes the folders of saves that never finished; returns their names."""
  removed = [os.path.basename(p) for p in partial_saves(ckpt_dir)]
  for _ in range(2):  # a writer coroutine may still create a file right after the first pass
    for p in partial_saves(ckpt_dir):
      shutil.rmtree(p, ignore_errors=True)
    time.sleep(0.2)
  return removed


# ------------------------------------------------------------------------------ manager

class Checkpointer:
  def __init__(self, workdir: str, cfg: CheckpointConfig):
    import orbax.checkpoint as ocp  # noqa: PLC0415 (heavy: orbax, ~1 s; jax-free at import: see the module docstring)
    self._ocp = ocp
    self.dir = checkpoint_dir(workdir)
    if os.path.exists(self.dir) and not os.path.isdir(self.dir):
      raise CheckpointError(f"{self.dir} exists but is not a directory, so checkpoints cannot be written there: "
                            f"move it away or use another --workdir", kind="io")
    _install_noise_filters()
    self.incomplete = [os.path.basename(p).split(".")[0] for p in partial_saves(self.dir)]
    if self.incomplete:  # removed by the manager below; say so, or a rerun would start over without a word
      log.warning("removing incomplete save(s) of step %s in %s (a run stopped while writing them)",
                  ", ".join(self.incomplete), self.dir)
    opts = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                        create=True, cleanup_tmp_directories=True)
    try:
      self.mgr = ocp.CheckpointManager(self.dir, options=opts, item_handlers={
          "state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()})
    except (OSError, ValueError) as e:
      raise CheckpointError(f"cannot open checkpoint folder {self.dir} ({type(e).__name__}: {e}): check its "
                            f"permissions or use another --workdir", kind="io") from e
    self.save_s: List[float] = []  # blocking part of each save (checksum + device-to-host copy + dispatch)
    self._failed = False

  def latest_step(self) -> Optional[int]:
    return self.mgr.latest_step()

  def save(self, step: int, state: Any, data_state: dict, force: bool = False) -> bool:
    """Starts an (async) save of ``step``; an earlier save's failure surfaces here or in ``wait``. A full disk
    is a CheckpointError(kind='io'), with the partial save removed and the complete steps kept."""
    ocp = self._ocp
    t0 = time.perf_counter()
    data = dict(data_state, **{INTEGRITY_KEY: {"checksum": state_checksum(state)}})
    with self._write_errors(step):
      ok = self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       data=ocp.args.JsonSave(data)), force=force)
    self.save_s.append(time.perf_counter() - t0)
    return ok

  @contextlib.contextmanager
  def _write_errors(self, step: Optional[int]):
    try:
      yield
    except Exception as e:  # noqa: BLE001 - orbax reports a failed write as ValueError / OSError / others
      if not disk_full(e):
        raise
      self._failed = True
      partial = [os.path.basename(p) for p in partial_saves(self.dir)]
      self._remove_partial()
      kept = sorted(step_dirs(self.dir))
      which = ", ".join(p.split(".")[0] for p in partial) or step
      raise CheckpointError(
          f"no space left on device while saving checkpoint step {which} "
          f"in {self.dir}: free space there (or use a --workdir on a larger disk) and rerun to resume from "
          f"{'step ' + str(kept[-1]) if kept else 'step 0'}; the partial save was removed, the complete "
          f"checkpoints {kept or '(none)'} are kept", kind="io", step=step) from None

  def _remove_partial(self):
    import jax  # noqa: PLC0415 (jax-free at import: see the module docstring)
    if jax.process_index() == 0:  # shared storage: process 0 removes
      remove_partial_saves(self.dir)

  # -- restore ---------------------------------------------------------------------------------------
  def check_compatible(self, step: int, abstract_state: Any) -> Optional[str]:
    """None if the step's saved tree matches ``abstract_state`` (paths, shapes, dtypes), else the first difference.
    Raises CheckpointError(kind='corrupt') if its metadata cannot be read."""
    why = quick_check(self.dir, step)
    if why is not None:
      raise CheckpointError(why, step=step)
    try:
      with _quiet_orbax_failures():
        meta = self.mgr.item_metadata(step)
      saved_tree = meta["state"] if not hasattr(meta, "state") else meta.state
      saved_tree = getattr(saved_tree, "tree", saved_tree)
      saved = _tree_signature(saved_tree)
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; all mean unreadable metadata
      raise CheckpointError(f"metadata unreadable ({type(e).__name__}: {str(e)[:160]})", step=step) from e
    want = _tree_signature(abstract_state)
    if not saved:
      raise CheckpointError("metadata lists no arrays", step=step)
    only_saved, only_want = sorted(set(saved) - set(want)), sorted(set(want) - set(saved))
    if only_saved or only_want:
      return (f"its state tree differs ({len(only_want)} array(s) this config needs are absent, e.g. "
              f"{(only_want or ['-'])[0]!r}; {len(only_saved)} saved array(s) are unknown to it, e.g. "
              f"{(only_saved or ['-'])[0]!r})")
    for k in sorted(want):
      if saved[k] != want[k]:
        return f"{k} was saved as {saved[k][0]} {saved[k][1]}, this config needs {want[k][0]} {want[k][1]}"
    return None

  def restore_step(self, abstract_state: Any, step: int):
    """Restores exactly ``step`` and verifies it; raises CheckpointError (kind foreign / corrupt) otherwise."""
    ocp = self._ocp
    foreign = self.check_compatible(step, abstract_state)
    if foreign is not None:
      raise CheckpointError(
          f"checkpoint step {step} in {self.dir} was written by another model or state layout: {foreign}. "
          f"Resume with the config that wrote it, or use a fresh --workdir", kind="foreign", step=step)
    try:
      with _quiet_orbax_failures():
        out = self.mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                             data=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; all mean unreadable data here
      raise CheckpointError(f"unreadable ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})",
                            step=step) from e
    data = dict(out.data or {})
    integrity = data.pop(INTEGRITY_KEY, None)
    if integrity is not None and integrity.get("checksum") != state_checksum(out.state):
      raise CheckpointError("checksum mismatch: the array data changed after it was written", step=step)
    return out.state, data

  def restore(self, abstract_state: Any, step: Optional[int] = None):
    """Restores ``step``, or the latest step that restores and verifies (moving newer bad steps aside)."""
    if step is not None:
      try:
        return self.restore_step(abstract_state, step)
      except CheckpointError as e:
        if e.kind == "foreign":
          raise
        raise CheckpointError(f"checkpoint step {step} in {self.dir} cannot be restored: {e}. Pick another step, "
                              f"or move that step folder away", step=step) from e
    steps = sorted(self.mgr.all_steps(), reverse=True)
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.dir}", kind="io")
    bad = []
    for s in steps:
      try:
        state, data = self.restore_step(abstract_state, s)
      except CheckpointError as e:
        if e.kind == "foreign":
          raise
        bad.append((s, str(e)))
        continue
      self._set_aside(bad)
      if bad:
        log.warning("resumed from checkpoint step %d: newer step(s) %s could not be used and were moved to %s",
                    s, "; ".join(f"{b} ({why})" for b, why in bad), os.path.join(os.path.dirname(self.dir), BAD_DIR))
      return state, data
    raise CheckpointError(f"no checkpoint in {self.dir} can be restored ({'; '.join(f'step {b}: {w}' for b, w in bad)}): "
                          f"move that folder away (nothing was deleted) or use a fresh --workdir")

  def _set_aside(self, bad) -> None:
    if not bad:
      return
    import jax  # noqa: PLC0415 (jax-free at import: see the module docstring)
    multi = jax.process_count() > 1
    if multi:  # every process has finished reading before process 0 moves folders
      from jax.experimental import multihost_utils  # noqa: PLC0415 (jax-free at import: see the module docstring)
      multihost_utils.sync_global_devices("prismllm_ckpt_quarantine_before")
    if jax.process_index() == 0:
      for s, why in bad:
        quarantine(self.dir, s, why)
    if multi:
      multihost_utils.sync_global_devices("prismllm_ckpt_quarantine_after")
    self.mgr.reload()

  def wait(self):
    with self._write_errors(None):
      self.mgr.wait_until_finished()

  def close(self):
    """Waits for the last save (its failure raised, once) and closes the manager."""
    if not self._failed:
      try:
        self.wait()
      except BaseException:
        with contextlib.suppress(Exception):  # after a failed write the manager re-raises the same error
          self.mgr.close()
        raise
      self.mgr.close()
      return
    with contextlib.suppress(Exception):
      self.mgr.close()
