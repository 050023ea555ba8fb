"""``prismllm-ondevice``: the console script of on-device inference (setup.cfg entry points).

Each subcommand is an existing command, called with the rest of the command line (framework/commands.py):
``prismllm-ondevice run ...`` is ``python -m ondevice.run ...``; likewise serve, export, bench.
"""
from __future__ import annotations

import sys

from framework.commands import Table, dispatch

DOC = "PrismLLM on-device inference: GGUF models on one device or a ring of memory-starved devices."
COMMANDS: Table = {
    "run": ("ondevice.run", "main", (), "generate from a GGUF model, alone or over a device ring"),
    "serve": ("ondevice.serve", "main", (), "an OpenAI-compatible HTTP server for a GGUF model"),
    "export": ("ondevice.export", "main", (), "a training workdir (or random weights) to a GGUF file"),
    "bench": ("ondevice.bench", "main", (), "benchmarks: ours vs llama.cpp, kernels, the ring, speculative decoding"),
}


def main(argv=None) -> int:
  return dispatch("prismllm-ondevice", COMMANDS, DOC, argv)


if __name__ == "__main__":
  sys.exit(main())
