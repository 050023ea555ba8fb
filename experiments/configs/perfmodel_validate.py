"""Perfmodel accuracy study (Charon-style figure): the validation suite of perfmodel/calib/suite.py on this host.

Commands:
  python -m perfmodel calibrate                      # fit the cpu profile (up to an hour on 2 cores)
  python -m perfmodel validate --rounds 3 --png benchmarks/perfmodel_validate.png > /tmp/perfmodel_validate.json
  python experiments/figures/perfmodel_accuracy.py /tmp/perfmodel_validate.json /tmp/perfmodel_accuracy.png
Reproduces: predicted-vs-measured scatter and per-config signed error with the run-to-run noise beside it
(perfmodel/README.md). get_config returns the suite's base training config (a valid experiment).
"""
import ml_collections

from perfmodel.calib.suite import BASE


def get_config(arg=None):
  c = ml_collections.ConfigDict({k: dict(v) for k, v in BASE.items()})
  c.name = "perfmodel_validate"
  c.lock()
  return c
