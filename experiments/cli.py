"""``prismllm``: the console script of training, the performance model and emulation (setup.cfg entry points).

Each subcommand is an existing command, called with the rest of the command line (framework/commands.py):
``prismllm train ...`` is ``python -m experiments.run ...``, ``prismllm predict ...`` is
``python -m perfmodel predict ...`` (likewise validate, search, floor, calibrate), ``prismllm emulate ...`` is
``python -m perfmodel emulate ...``.
"""
from __future__ import annotations

import sys

from framework.commands import Table, dispatch

DOC = "PrismLLM: train a config, predict / validate / search its step time and memory, emulate it at scale."
COMMANDS: Table = {
    "train": ("experiments.run", "cli", (), "train a config (python -m experiments.run)"),
    "predict": ("perfmodel.cli", "main", ("predict",), "step time / tokens/s / MFU / memory of a config on a target"),
    "validate": ("perfmodel.cli", "main", ("validate",), "measured vs predicted on this host, or --published runs"),
    "search": ("perfmodel.cli", "main", ("search",), "rank layouts for a model on N devices under memory limits"),
    "floor": ("perfmodel.cli", "main", ("floor",), "what a perfect model scores between stored measurement sets"),
    "calibrate": ("perfmodel.cli", "main", ("calibrate",), "fit the cpu profile on this host (into the user's cache)"),
    "emulate": ("perfmodel.emulate.cli", "main", (), "emulate a step at the target scale from one real rank"),
}


def main(argv=None) -> int:
  return dispatch("prismllm", COMMANDS, DOC, argv)


if __name__ == "__main__":
  sys.exit(main())
