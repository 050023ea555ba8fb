"""Perfmodel accuracy study (Charon-style figure): the validation suite of perfmodel/calib/suite.py on this host.

Commands:
  # fit the cpu profile (up to an hour on 2 cores) into ~/.cache/prismllm/profiles, which validate then reads (kept
  # only if it passes the gate); --commit would overwrite the committed perfmodel/profiles/cpu.json and its node data
  python -m perfmodel calibrate
  # measured vs predicted (--record would also write the committed benchmarks/perfmodel_validate.png and
  # benchmarks/data/perfmodel_validate.json)
  python -m perfmodel validate --rounds 3 --png /tmp/perfmodel_validate.png > /tmp/perfmodel_validate.json
  python -m experiments.figures.perfmodel_accuracy /tmp/perfmodel_validate.json /tmp/perfmodel_accuracy.png
Reproduces: predicted-vs-measured scatter and per-config signed error with the run-to-run noise beside it
(perfmodel/README.md). get_config returns the suite's base training config (a valid experiment, already CPU-sized:
2 layers, d=128, one device), so it takes no variant argument.
"""
import ml_collections

from framework.config import ConfigError
from perfmodel.calib.suite import BASE


def get_config(arg=None):
  if arg:
    raise ConfigError(f"perfmodel_validate.py takes no argument (got {arg!r}): its config is already CPU-sized")
  c = ml_collections.ConfigDict({k: dict(v) for k, v in BASE.items()})
  c.name = "perfmodel_validate"
  c.lock()
  return c
