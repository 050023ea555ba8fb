"""Charon-style accuracy figure from `python -m perfmodel validate` JSON output.

  python -m experiments.figures.perfmodel_accuracy VALIDATE.json OUT.png
Left: predicted vs measured (log-log, y = x dashed, x error bars = run-to-run noise).
Right: signed error per config with the noise band, MAPE and Kendall tau in the title.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, out):
  with open(src) as f:
    lines = [l for l in f.read().splitlines() if l.strip().startswith("{")]
  d = json.loads(lines[-1])
  rows = d["rows"]
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
  for kind, mk in (("train", "o"), ("infer", "^")):
    rr = [r for r in rows if r["kind"] == kind]
    if rr:
      a.errorbar([r["measured_s"] * 1e3 for r in rr], [r["predicted_s"] * 1e3 for r in rr],
                 xerr=[r["measured_s"] * 1e3 * min(r["noise_pct"], 99) / 100 for r in rr], fmt=mk, label=kind)
  lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.5
  hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.5
  a.plot([lo, hi], [lo, hi], "k--", lw=0.8)
  a.set_xscale("log"), a.set_yscale("log"), a.set_xlabel("measured ms"), a.set_ylabel("predicted ms"), a.legend()
  names = [r["name"] for r in rows]
  b.bar(range(len(rows)), [r["err_pct"] for r in rows], color=["C0" if r["kind"] == "train" else "C1" for r in rows])
  b.errorbar(range(len(rows)), [0] * len(rows), yerr=[min(r["noise_pct"], 200) for r in rows], fmt="none", ecolor="gray")
  b.set_xticks(range(len(rows)), names, rotation=70, fontsize=7)
  b.set_ylabel("signed error % (gray: noise)")
  b.set_title(f"MAPE {d['mape']:.1f}%  tau {d['kendall_tau']:.2f}  noise {d['noise_pct']:.1f}%  (n={d['n_configs']})")
  fig.tight_layout()
  fig.savefig(out, dpi=120)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
