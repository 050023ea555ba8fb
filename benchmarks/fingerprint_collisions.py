"""How often does the profiled database's key (graph.Node.fingerprint) name two different instructions?

  PYTHONPATH=. python benchmarks/fingerprint_collisions.py [--programs decode_b4,base,...] [--no-results]

The profiled database (perfmodel/fusion_profiler.py) and the hybrid backend key an instruction's alone time by its
fingerprint: kind, opcode, output shape, flops, transcendentals, bytes. Two instructions that compute different
things with the same signature share one entry, whichever was timed first (session 23: a KV-cache
dynamic-update-slice of decode_b8_wide priced with the alone time of a broadcast filling the whole cache, 28.7
vs 13 us). This compiles the named suite / calibration programs (nothing is timed), gives every compute
instruction a structure signature (its opcode and its fused computation's opcode sequence) and counts the
fingerprints that carry more than one signature across the programs, and per program the share of the
hybrid's priced time that sits on such fingerprints. Since session 24 the fingerprint carries a hash of the fused
opcode sequence (graph.structure_tag), so this checks that no key names two structures (70 of 1021 before). Prints one JSON object; appends a row to
benchmarks/RESULTS.md unless --no-results.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DEFAULT = ("decode_b1,decode_b4,decode_b8_wide,base,remat_full,seq128,deep8_narrow,c_decode_b5_d112,c_decode_b6,"
           "c_d112_s72")


def signature(prog, comp: str, name: str) -> str:
  ins, _ = prog.instrs[comp][name]
  called = prog.called_closure(ins)
  return ins.opcode + "|" + ";".join(i.opcode for c in called[:1] for i, _ in prog.instrs[c].values())


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--programs", default=DEFAULT)
  ap.add_argument("--no-results", action="store_true")
  args = ap.parse_args(argv)
  from perfmodel import capture, costs, fusion_profiler as fp, graph as graph_lib, hardware, suite, validate
  hw = hardware.load("cpu")
  chain = costs.make_chain(hw, "auto")
  by = {e["name"]: e for e in suite.SUITE + suite.INFER + suite.CALIBRATION + suite.CALIBRATION_INFER}
  sigs = collections.defaultdict(set)
  nodes = {}
  for name in args.programs.split(","):
    e = by[name]
    cfg, _, kind = validate._entry_cfg(suite, e)
    cap = (capture.sampler(cfg, e["batch"], e["prompt_len"], e["gen_lens"][1]) if kind == "infer"
           else capture.train_step(cfg))
    prog = fp.ProgramText(cap.hlo_text)
    where = {n: c for c, ins in prog.instrs.items() for n in ins}
    g = graph_lib.from_hlo_text(cap.hlo_text, cap.n_devices)
    nodes[name] = [(n, m) for n, m in g.walk() if n.kind in graph_lib.COMPUTE_KINDS]
    for n, _ in nodes[name]:
      sigs[n.fingerprint].add(signature(prog, where[n.name], n.name))
  bad = {k for k, v in sigs.items() if len(v) > 1}
  share = {}
  for name, ns in nodes.items():
    priced = [(n, m, getattr(chain.price(n), "seconds", 0.0)) for n, m in ns]  # one pricing per node
    tot = sum(s * m for _, m, s in priced)
    share[name] = {"pct_of_priced_time": round(100 * sum(s * m for n, m, s in priced if n.fingerprint in bad) / tot, 1),
                   "nodes": sum(n.fingerprint in bad for n, _, _ in priced)}
  out = {"benchmark": "fingerprint_collisions", "programs": list(nodes), "distinct_fingerprints": len(sigs),
         "colliding_fingerprints": len(bad), "per_program": share,
         "examples": {k: sorted(sigs[k])[:3] for k in sorted(bad)[:5]}}
  print(json.dumps(out))
  if not args.no_results:
    per = ", ".join(f"{k} {v['pct_of_priced_time']}%" for k, v in share.items())
    row = (f"| {datetime.datetime.now().isoformat(timespec='minutes')} | `PYTHONPATH=. python "
           f"benchmarks/fingerprint_collisions.py` | compile only | profiled-database keys naming more than one "
           f"instruction structure: {len(bad)} of {len(sigs)} fingerprints; share of the hybrid's priced time on "
           f"them: {per} |")
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as fh:
      fh.write(row + "\n")
  return out


if __name__ == "__main__":
  main()
