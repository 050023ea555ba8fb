"""Bad inputs and faults, per area: does the system recover or fail loudly?

  python -m benchmarks.reliability [--workdir DIR] [--area ondevice|resilience ...] [--only NAME ...]
                                   [--class CLASS ...] [--fast] [--out PATH] [--commit]

Runs every selected case in its own subprocess and prints one JSON object: the counts per area and in total
(bad_inputs_tried, recovered, clear_errors, unclear_errors, crashes, hangs, silent, not_exercised, data_lost),
per class, and every case's outcome; a case that could not make its fault happen is ``not_exercised``, counted
apart and named. The JSON is also written to --out (default: <workdir>/reliability.json); nothing is written
into the repository unless --commit, which records the whole campaign in benchmarks/data/reliability.json
(``python -m benchmarks.results`` renders it into benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile


def main(argv=None) -> int:
  from benchmarks.reliability import campaign  # noqa: PLC0415
  argv = sys.argv[1:] if argv is None else argv
  ap = argparse.ArgumentParser(prog="python -m benchmarks.reliability", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--area", action="append", choices=sorted(campaign.AREAS), help="repeatable; default: every area")
  ap.add_argument("--only", nargs="+", default=[], metavar="NAME", help="only these cases or case classes")
  ap.add_argument("--class", dest="classes", action="append", default=[], help="only this case class (repeatable)")
  ap.add_argument("--fast", action="store_true", help="skip the slow cases (the multi-minute hot-swap jobs)")
  ap.add_argument("--workdir", default=None, help="where the good and corrupted files go (default: a temp dir)")
  ap.add_argument("--out", default=None, help="where the JSON goes (default: <workdir>/reliability.json)")
  ap.add_argument("--commit", action="store_true",
                  help="also write benchmarks/data/reliability.json (the whole campaign only)")
  ap.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.run_one:
    if not args.workdir:
      ap.error("--run-one needs --workdir")
    return campaign.run_one(args.run_one, args.workdir)
  areas = args.area or sorted(campaign.AREAS)
  if args.commit and (args.only or args.classes or args.fast or set(areas) != set(campaign.AREAS)):
    ap.error("--commit records the whole campaign: drop --only, --class, --fast and --area, or write a part "
             "with --out instead")
  missing = campaign.unknown(args.only + args.classes, areas)
  if missing:
    ap.error(f"no case or class named {', '.join(missing)} in area(s) {', '.join(areas)}: check the spelling, or "
             f"pass the --area that has it")
  workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="reliability-"))
  res = campaign.run(areas, workdir, args.only, args.classes, args.fast,
                     log=lambda s: print(s, file=sys.stderr, flush=True))
  res["command"] = ("python -m benchmarks.reliability " + " ".join(argv)).strip()
  res["date"] = datetime.datetime.now().isoformat(timespec="minutes")
  print(json.dumps(res))
  print(f"wrote {campaign.write(res, args.out or os.path.join(workdir, 'reliability.json'))}", file=sys.stderr)
  if args.commit:
    print(f"wrote {campaign.write(res, campaign.COMMITTED)}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
