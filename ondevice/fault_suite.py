"""Every case of the ondevice area, registered: what the reliability benchmark (``benchmarks/reliability.py``)
and ``tests/ondevice/test_faults.py`` load. Same interface as the resilience area's registry: ``AREA``,
``load_cases()``, ``classes()``, ``Workspace``, ``run_case``, ``summarise``.
"""
from ondevice import faults_cases, faults_run_cases, faults_serve_cases  # noqa: F401 - importing registers them
from ondevice.faults import AREA, CASES, Workspace, classes, run_case, summarise  # noqa: F401 - the interface


def load_cases() -> list:
  return CASES
