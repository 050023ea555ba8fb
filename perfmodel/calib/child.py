"""The measuring child processes: ``python -m perfmodel.calib.child KIND OUT JSON`` (started by
perfmodel/calib/runners.py ``child_json`` with exactly the virtual devices its work needs).

  measure  time the named suite / calibration entries (runners.measure_entries), the probe around each if asked
  trace    node samples of the one-device calibration programs (perfmodel/calib/nodes.py trace_programs)
  probe    the host-speed probe alone (perfmodel/calib/host.py)
The allocator regime of the real job is applied before jax starts, as ``python -m experiments.run`` does.
"""
from __future__ import annotations

import json
import sys

from framework import host_memory


def main(argv) -> int:
  host_memory.apply()
  if len(argv) != 3 or argv[0] not in ("measure", "trace", "probe"):
    sys.exit("usage: python -m perfmodel.calib.child measure|trace|probe OUT JSON (started by perfmodel calibrate / "
             "validate)")
  kind, out_path, req = argv[0], argv[1], json.loads(argv[2])
  # jax and what compiles on it load after the allocator settings (they apply to threads created afterwards)
  from perfmodel.calib import host, nodes, runners  # noqa: PLC0415 (loads jax: after host_memory.apply())
  if kind == "measure":
    probe = host.HostSpeed.probe() if req["probe"] else None
    got = runners.measure_entries(req["suite"], req["names"], req["reps"], probe)
  elif kind == "trace":
    got = nodes.trace_programs(req["profile"], req["trace_reps"])
  else:
    probe = host.HostSpeed.probe()
    probe.measure(reps=2)  # warm
    got = probe.measure(reps=int(req.get("reps", 2 * host.PROBE_REPS)))
  with open(out_path, "w") as f:
    json.dump(got, f)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
