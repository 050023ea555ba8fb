"""The profiler's worker process: ``python -m perfmodel.cost.worker`` (started by perfmodel/cost/profiler.py) reads
standalone instructions as JSON lines on stdin, compiles and times each, and answers one line per job. It runs in the
real job's allocator regime and pinned to one core if its parent was not (a caller that does not measure, such as
``predict``, still gets the calibration's regime); both are set before jax starts."""
import sys

from framework import host_memory
from perfmodel.cost import regime

if __name__ == "__main__":
  host_memory.apply()
  if not regime.pinned():
    regime.pin()
  from perfmodel.cost import profiler  # noqa: PLC0415 (jax starts after the allocator and the pinning)
  sys.exit(profiler.worker_main())
