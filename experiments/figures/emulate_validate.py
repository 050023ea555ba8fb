"""Emulation validation figure from benchmarks/data/emulate_validate.json (`python -m benchmarks.emulate_validate`
writes both).

  python -m experiments.figures.emulate_validate benchmarks/data/emulate_validate.json /tmp/emulate_validate.png
Left: per layout, measured (real 2-process run, bar = p10-p90 of its steps), emulated, `perfmodel predict`
and roofline step time. Right: signed iteration-time error of emulation per round (dots) and overall
(bar), with the 2% target band and the real run's noise.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(src, out):
  with open(src) as f:
    d = json.load(f)
  lays = list(d["layouts"])
  fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
  w = 0.2
  series = (("measured (real)", "real_s", "k"), ("emulate", "emulated_s", "tab:blue"),
            ("predict", "predict_s", "tab:orange"), ("roofline", "roofline_s", "tab:gray"))
  for i, (lab, key, col) in enumerate(series):
    ys = [(d["layouts"][l][key] or 0) * 1e3 for l in lays]
    a.bar([j + (i - 1.5) * w for j in range(len(lays))], ys, w, label=lab, color=col)
  a.set_xticks(range(len(lays)), lays)
  a.set_ylabel("step time (ms)")
  a.set_yscale("log")
  a.legend(fontsize=8)
  a.set_title(f"2 ranks on localhost (gloo), {d['rounds']} interleaved rounds")
  for j, l in enumerate(lays):
    v = d["layouts"][l]
    b.bar(j, v["error_pct"], 0.5, color="tab:blue", alpha=0.6)
    b.scatter([j] * len(v["paired_error_pct"]), v["paired_error_pct"], color="k", s=12, zorder=3)
    b.errorbar(j + 0.3, 0, yerr=v["real_noise_p10_p90_pct"] / 2, color="tab:red", capsize=4)
  b.axhspan(-2, 2, color="tab:green", alpha=0.15, label="target |error| <= 2%")
  b.axhline(0, color="k", lw=0.8)
  b.set_xticks(range(len(lays)), lays)
  b.set_ylabel("emulated / real - 1 (%)")
  b.set_title(f"mean |error| {d['mean_abs_error_pct']:.1f}% (red: half the real run's p10-p90 noise)")
  b.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  return out


if __name__ == "__main__":
  print(plot(sys.argv[1], sys.argv[2]))
