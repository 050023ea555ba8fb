"""What every benchmark records beside its numbers: the command that produced them, the machine and the date."""
from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys


def command(module: str, argv: list = None) -> str:
  """The command line that reruns this benchmark: ``python -m MODULE ARGS``."""
  args = sys.argv[1:] if argv is None else list(argv)
  return " ".join(["python", "-m", module, *(shlex.quote(a) for a in args)])


def machine(extra: str = "") -> str:
  return f"{platform.machine()} {os.cpu_count()} cores (shared)" + (f", {extra}" if extra else "")


def now() -> str:
  return datetime.datetime.now().isoformat(timespec="minutes")


def stamp(module: str, argv: list = None, extra: str = "") -> dict:
  """``{"command", "machine", "date"}`` for a data file."""
  return {"command": command(module, argv), "machine": machine(extra), "date": now()}
