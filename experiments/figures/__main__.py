"""Regenerates every registered paper figure from committed data (see registry.py for the API).

  python -m experiments.figures                 # every figure -> benchmarks/figures/NAME.png
  python -m experiments.figures --list          # name, paper, the paper's number, data files, rerun command
  python -m experiments.figures --only NAME     # one figure (repeatable)
  python -m experiments.figures --rerun NAME    # re-measure NAME's data at this host's scale, then draw it
  python -m experiments.figures --out-dir DIR   # write the PNGs to DIR/NAME.png instead
A figure whose data file is absent prints one line naming the command that produces it; the others still draw.
The last stdout line is a JSON summary {name: {"png", "ours", "paper", "seconds"} or {"missing"}}.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import matplotlib

matplotlib.use("Agg")

from experiments.figures import registry  # noqa: E402


def _rerun(fig) -> None:
  if not fig.rerun:
    raise SystemExit(f"{fig.name} has no rerun command")
  # `python` in a rerun command is this interpreter (its bin folder first on PATH), with the repository importable
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([registry.ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
             PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
  print(f"[{fig.name}] rerun: {fig.rerun}", flush=True)
  subprocess.run(fig.rerun, shell=True, cwd=registry.ROOT, env=env, check=True)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m experiments.figures", description=__doc__.split("\n")[0])
  ap.add_argument("--list", action="store_true", help="list the registered figures and exit")
  ap.add_argument("--only", action="append", default=[], metavar="NAME", help="draw only NAME (repeatable)")
  ap.add_argument("--rerun", action="append", default=[], metavar="NAME",
                  help="re-measure NAME's data with its rerun command, then draw it (repeatable)")
  ap.add_argument("--out-dir", default=None, help="write DIR/NAME.png instead of each figure's committed path")
  a = ap.parse_args(argv)
  figs = registry.discover()
  unknown = [n for n in a.only + a.rerun if n not in figs]
  if unknown:
    ap.error(f"unknown figure(s) {unknown}; known: {', '.join(figs)}")
  if a.list:
    for f in figs.values():
      print(f"{f.name:28s} {f.paper:10s} paper: {f.paper_number}\n{'':28s} data: {', '.join(f.data) or '-'}\n"
            f"{'':28s} rerun: {f.rerun or '-'}\n{'':28s} png: {f.out}")
    return 0
  done = set()
  for n in a.rerun:  # figures that share a data file share its command: run it once
    if figs[n].rerun not in done:
      _rerun(figs[n])
      done.add(figs[n].rerun)
  names = a.only + [n for n in a.rerun if n not in a.only] or list(figs)
  summary, t_all = {}, time.perf_counter()
  for n in names:
    f = figs[n]
    out = os.path.join(a.out_dir, f"{n}.png") if a.out_dir else os.path.join(registry.ROOT, f.out)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    t0 = time.perf_counter()
    try:
      res = f.draw(out) or {}
    except registry.MissingData as e:
      print(f"[{n}] skipped: {e}", flush=True)
      summary[n] = {"missing": str(e)}
      continue
    dt = time.perf_counter() - t0
    summary[n] = {"png": out, "ours": res.get("ours", ""), "paper": f.paper_number, "seconds": round(dt, 2)}
    print(f"[{n}] {out} ({dt:.1f} s)  ours: {res.get('ours', '')}  paper: {f.paper_number}", flush=True)
  print(f"{len([s for s in summary.values() if 'png' in s])}/{len(names)} figures in "
        f"{time.perf_counter() - t_all:.1f} s", flush=True)
  print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())
