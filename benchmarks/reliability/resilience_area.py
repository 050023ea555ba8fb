"""The resilience / checkpoint / config area of the campaign: config, checkpoints, hot swap, and a run's life cycle
(stop signals, the workdir lock, checks before write, a full disk). Its cases (``resilience_cases.py``,
``hotswap_cases.py``, ``lifecycle_cases.py``) run the real entry point (``python -m experiments.run``, or the
hot-swap launcher) in a subprocess in its own session; a refusal is exit code 2/3/4/5, no traceback, and a last
stderr line ``config error: / checkpoint error: / hot-swap run failed: / workdir error: ...`` that names a fix.
The case modules register into ``CASES``; ``campaign.load_cases("resilience")`` imports them.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

from benchmarks.reliability import harness
from benchmarks.reliability.harness import Outcome, Run, Workspace  # noqa: F401 - the area's workspace

AREA = "resilience"
CASES = harness.Registry(AREA, timeout_s=300.0)
case = CASES.case
REFUSAL = harness.Refusal(
    line=re.compile(r"^(config error|checkpoint error|hot-swap run failed|workdir error): "),
    fix=re.compile(r"must be|must exceed|use |pass |move |rerun|resume with|choose|fix |set |raise |wait |add |"
                   r"stop |give |known|try |lower |delete |check |free ", re.I),
    codes=(2, 3, 4, 5), last=True)


def classify(r: Run, ok: Optional[Callable[[Run], bool]] = None) -> Outcome:
  return harness.classify(r, REFUSAL, ok)
