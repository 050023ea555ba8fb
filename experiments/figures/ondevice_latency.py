"""Shape of prima.cpp's latency table at our scale: per-token latency of the best single device (whole model
mmap'd, LRU: llama.cpp-like), an exo-like RAM-proportional split, a dllama-like tensor-parallel split and
Halda + pipelined ring, across model sizes, on the EMULATED 4-device setup of benchmarks/ondevice_devices4.yaml
(ondevice/bench_ring.py). Every time is on the emulated clock.

  # run the sweep (random-weight "small"-shape Q8_0 models of 4, 8, 16 layers), save its runs and plot
  python -m experiments.figures.ondevice_latency --sweep 4,8,16 --json-out /tmp/sizes.json --out /tmp/ondevice_latency.png
  # or plot saved `python -m ondevice.bench --suite ring` JSON outputs
  python -m experiments.figures.ondevice_latency ring_a.json ring_b.json --out fig.png
"""
import argparse
import json
import os
import tempfile

SCEN = [("best_single", "best single device, mmap (llama.cpp-like)"),
        ("exo_like_memory_split", "exo-like RAM-proportional split"),
        ("dllama_like_tensor_parallel", "dllama-like tensor-parallel split"),
        ("halda_ring", "Halda + pipelined ring (ours)")]


def _tpot(ring, s):
  return ring[f"alone_{ring['best_single_device']}"]["tpot_ms"] if s == "best_single" else ring[s]["tpot_ms"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sweep(layers, devices, tokens, workdir):
  import jax
  from framework import model as fm
  from framework.config import ModelConfig
  from ondevice import bench_ring, gguf_io
  runs = []
  for n_layers in layers:
    cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=n_layers, n_heads=8, n_kv_heads=4, d_ff=768,
                      max_seq_len=512, init_std=0.02)
    with jax.numpy_rank_promotion("allow"):
      params = fm.init_params(fm.build(cfg), jax.random.key(0))
    path = os.path.join(workdir, f"small_L{n_layers}_q8_0.gguf")
    gguf_io.export_gguf(params, cfg, path, "q8_0", name=f"small_L{n_layers}")
    ring = bench_ring.run(path, devices, tokens, list(b"def fibonacci(n):\n    "))
    runs.append({"model": f"L={n_layers} ({os.path.getsize(path) / 2**20:.1f} MiB)", "ring": ring})
    h = ring["halda_ring"]
    print(json.dumps({"layers": n_layers, **{s: round(_tpot(ring, s), 1) for s, _ in SCEN},
                      "halda_k": h.get("k"), "halda_w": h.get("w"), "halda_model_ms": h.get("halda_model_latency_ms"),
                      "clock": ring.get("clock", "emulated")}), flush=True)
  return runs


def plot(runs, out):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7.5, 4))
  width = 0.8 / len(SCEN)
  for j, (s, label) in enumerate(SCEN):
    ys = [_tpot(r["ring"], s) for r in runs]
    xs = [i + j * width for i in range(len(runs))]
    ax.bar(xs, ys, width, label=label)
    for x, y in zip(xs, ys):
      ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=7)
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))])
  ax.set_xticklabels([r["model"].split(":")[0] for r in runs])
  ax.set_ylabel("ms per token (EMULATED clock)")
  ax.set_yscale("log")
  ax.legend(fontsize=8)
  ax.set_title("Emulated 4-device ring (benchmarks/ondevice_devices4.yaml), Q8_0")
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  print(out)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("inputs", nargs="*")
  ap.add_argument("--sweep", default="", help="comma-separated layer counts to export and benchmark")
  ap.add_argument("--devices", default=os.path.join(ROOT, "benchmarks/ondevice_devices4.yaml"))
  ap.add_argument("--tokens", type=int, default=12)
  ap.add_argument("--json-out", default=None, help="save the sweep's results here")
  ap.add_argument("--out", default="ondevice_latency.png")
  a = ap.parse_args()
  if a.sweep:
    with tempfile.TemporaryDirectory() as d:
      runs = sweep([int(x) for x in a.sweep.split(",")], a.devices, a.tokens, d)
    if a.json_out:
      with open(a.json_out, "w") as f:
        json.dump(runs, f)
  else:
    runs = [json.load(open(p)) for p in a.inputs]
  plot(runs, a.out)


if __name__ == "__main__":
  main()
