"""Every case of the resilience / checkpoint / config area, registered: what the reliability benchmark
(``benchmarks/reliability_resilience.py``, or ``benchmarks/reliability.py`` collecting every area) and
``tests/resilience/test_faults.py`` load. Same interface as the ondevice area's registry: ``AREA``,
``load_cases()``, ``classes()``, ``Workspace``, ``run_case``, ``summarise``.
"""
# importing registers the cases
from resilience import faults_cases, faults_hotswap_cases, faults_lifecycle_cases  # noqa: F401
from resilience.faults import AREA, CASES, Workspace, classes, run_case, summarise  # noqa: F401 - the interface


def load_cases() -> list:
  return CASES
