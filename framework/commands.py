"""Console-script dispatch: ``prismllm SUBCOMMAND ...`` hands the rest of argv to an existing command's
``main(argv)`` (experiments/cli.py, ondevice/cli.py; installed by setup.cfg ``[options.entry_points]``).

Only the chosen command's module is imported, so ``--help`` starts no jax and each command keeps its own parser,
flags and exit codes; ``python -m MODULE ...`` runs the same ``main``.
"""
from __future__ import annotations

import importlib
import sys
from typing import Dict, Optional, Tuple

# subcommand -> (module, function, argv prefix, one-line help)
Table = Dict[str, Tuple[str, str, Tuple[str, ...], str]]


def usage(prog: str, table: Table, doc: str) -> str:
  width = max(len(c) for c in table)
  rows = "\n".join(f"  {c:<{width}}  {h}" for c, (_, _, _, h) in table.items())
  return (f"usage: {prog} {{{','.join(table)}}} [ARGS ...]\n\n{doc}\n\ncommands:\n{rows}\n\n"
          f"`{prog} COMMAND --help` shows a command's own flags.")


def dispatch(prog: str, table: Table, doc: str, argv: Optional[list] = None) -> int:
  """Runs ``argv[0]``'s command with ``argv[1:]``; ``-h`` / ``--help`` / nothing prints the commands."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(usage(prog, table, doc), file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
  if argv[0] not in table:
    print(f"{prog}: unknown command {argv[0]!r}; choose one of {', '.join(table)} (`{prog} --help`)",
          file=sys.stderr)
    return 2
  module, func, prefix, _ = table[argv[0]]
  rc = getattr(importlib.import_module(module), func)([*prefix, *argv[1:]])
  return int(rc or 0)
