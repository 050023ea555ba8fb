"""Bar chart of emulated TPOT per scenario from `python -m ondevice.bench --suite ring` JSON output(s).

  python -m ondevice.bench --model m.gguf --suite ring --devices d.yaml --no-append > ring.json
  python experiments/figures/ondevice_latency.py ring.json [more.json ...] --out ondevice_latency.png
Shape of prima.cpp's latency table (single device vs exo-like vs dllama-like vs Halda+PRP), one group per
model file; all times are on the EMULATED clock.
"""
import argparse
import json

SCEN = ["single_mmap", "exo_like_memory_split", "dllama_like_equal_split", "halda_k1_prefetch", "halda_prp_prefetch"]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("inputs", nargs="+")
  ap.add_argument("--out", default="ondevice_latency.png")
  a = ap.parse_args()
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  runs = [json.load(open(p)) for p in a.inputs]
  fig, ax = plt.subplots(figsize=(8, 4))
  width = 0.8 / len(SCEN)
  for j, s in enumerate(SCEN):
    ys = [r["ring"][s]["tpot_ms"] for r in runs]
    ax.bar([i + j * width for i in range(len(runs))], ys, width, label=s)
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))])
  ax.set_xticklabels([r["model"].split(":")[0] for r in runs])
  ax.set_ylabel("TPOT, ms (emulated clock)")
  ax.set_yscale("log")
  ax.legend(fontsize=7)
  ax.set_title("On-device ring latency (emulated devices)")
  fig.tight_layout()
  fig.savefig(a.out, dpi=120)
  print(a.out)


if __name__ == "__main__":
  main()
