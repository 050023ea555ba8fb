"""Errors the CLIs print as one line naming the fix (no traceback), and the checks made before the first token.

``InputError``: a bad argument or devices file, or a plan that cannot run (context overflow, a Halda
problem with no feasible plan). ``PeerError``: a ring device died or stopped answering. ``GGUFError``
(gguf_check.py): a bad model file. ``cli`` runs a CLI body and turns these into ``error: ...`` + exit 2.
"""
from __future__ import annotations

import sys

from ondevice.gguf_check import GGUFError


class InputError(ValueError):
  """Bad command-line input or an infeasible plan; the message names the fix."""


class PeerError(RuntimeError):
  """A ring device process died or did not answer in time."""

  def __init__(self, msg: str, rank: int = -1, hung: bool = False):
    super().__init__(msg)
    self.rank, self.hung = rank, hung


LONG_CONTEXT_FLAG = "--allow-long-context"


def check_generation(prompt: list, max_tokens: int, ctx: int, vocab: int, gamma: int = 0,
                     trained_ctx: int = 0, allow_long: bool = False) -> None:
  """Everything about the token budget that is knowable before the first token. ``trained_ctx``: the model's
  trained context (the GGUF's context_length); positions past it need ``allow_long`` (LONG_CONTEXT_FLAG)."""
  if ctx < 1:
    raise InputError(f"--ctx {ctx}: the context must hold at least one token; pass --ctx >= 1")
  if max_tokens < 1:
    raise InputError(f"--max-tokens {max_tokens}: pass --max-tokens >= 1")
  if not prompt:
    raise InputError("empty prompt; pass --prompt TEXT or --prompt-ids")
  bad = [t for t in prompt if not 0 <= t < vocab]
  if bad:
    raise InputError(f"prompt token ids {bad[:4]} are outside this model's vocabulary [0, {vocab}); fix --prompt-ids")
  need = len(prompt) + max_tokens
  if trained_ctx and need > trained_ctx and not allow_long:
    room = trained_ctx - len(prompt)
    lower = f"lower --max-tokens to {room}" if room >= 1 else "shorten the prompt"
    raise InputError(f"a {len(prompt)}-token prompt plus --max-tokens {max_tokens} reaches position {need}, past the "
                     f"model's trained context of {trained_ctx} tokens: positions beyond it are untrained and RoPE "
                     f"scaling is not implemented, so the output there is unreliable; {lower}, or pass "
                     f"{LONG_CONTEXT_FLAG} (with --ctx >= {need}) to generate past it anyway")
  if need > ctx:
    room = ctx - len(prompt)
    lower = f"or lower --max-tokens to {room}" if room >= 1 else "or shorten the prompt"
    raise InputError(f"a {len(prompt)}-token prompt plus --max-tokens {max_tokens} needs a {need}-token context but "
                     f"--ctx is {ctx}: raise --ctx to {need} {lower}")
  if gamma < 0:
    raise InputError(f"--gamma {gamma}: pass --gamma >= 1")


def cli(body, *args) -> int:
  """Runs ``body(*args)``; bad input of a known kind -> one line on stderr and exit code 2."""
  try:
    return body(*args)
  except (GGUFError, InputError, PeerError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("error: interrupted", file=sys.stderr)
    return 130
