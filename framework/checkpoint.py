"""Orbax checkpoints of {train state, data-iterator state}, async by default.

The workdir path is made absolute (orbax refuses relative paths). Restoring needs the abstract
state with its shardings, so the same checkpoint restores into any mesh layout.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import orbax.checkpoint as ocp

from framework.config import CheckpointConfig


class CheckpointError(RuntimeError):
  pass


class Checkpointer:
  def __init__(self, workdir: str, cfg: CheckpointConfig):
    self.dir = os.path.join(os.path.abspath(workdir), "checkpoints")
    opts = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                        create=True)
    self.mgr = ocp.CheckpointManager(self.dir, options=opts, item_names=("state", "data"))

  def latest_step(self) -> Optional[int]:
    return self.mgr.latest_step()

  def save(self, step: int, state: Any, data_state: dict, force: bool = False) -> bool:
    return self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       data=ocp.args.JsonSave(data_state)), force=force)

  def restore(self, abstract_state: Any, step: Optional[int] = None):
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.dir}")
    try:
      out = self.mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                           data=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; all mean the same to a user
      raise CheckpointError(
          f"checkpoint step {step} in {self.dir} could not be restored ({type(e).__name__}: {e}). "
          f"It may be corrupt or from a different model config; delete that step directory to fall back "
          f"to an older one, or start a fresh --workdir.") from e
    return out.state, out.data

  def wait(self):
    self.mgr.wait_until_finished()

  def close(self):
    self.mgr.wait_until_finished()
    self.mgr.close()
