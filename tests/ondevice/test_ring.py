"""Pipelined ring over pyzmq == one process; emulated devices; speculative decoding == greedy."""
import numpy as np
import pytest

from ondevice import generate, planner
from ondevice.device import DeviceOptions
from ondevice.emulation import DeviceSpec, EmulatedCache
from ondevice.forward import GGUFLlama
from ondevice.gguf_io import read_info
from ondevice.ring import RingEngine
from ondevice.weights import MappedGGUF

from .conftest import PROMPT

MB = 2**20


def _logits(engine):
  first = engine.forward(PROMPT[:9], 0)
  rest = [engine.forward([t], i) for i, t in enumerate(PROMPT[9:], 9)]
  return np.concatenate([first] + rest)


@pytest.mark.multiprocess
@pytest.mark.parametrize("w,k", [((1, 3), 1), ((1, 1), 2), ((0, 1, 1), 2)])
def test_ring_equals_single_process(files, w, k):
  path = files["q8_0"]
  with RingEngine(path, [[list(range(4))]], [None]) as one:
    ref = _logits(one)
  windows = planner.split_windows(w, k)
  with RingEngine(path, windows, [None] * len(w)) as ring:
    got = _logits(ring)
    stats = ring.stats()
  assert np.abs(got - ref).max() <= 1e-5
  assert [s["rank"] for s in stats] == list(range(len(w)))
  assert sum(s["layers"] for s in stats) == 4


@pytest.mark.multiprocess
def test_emulated_ring_and_speculative_equal_greedy(files):
  specs = [DeviceSpec("a", ram_bytes=0.3 * MB, disk_Bps=20 * MB, link_Bps=50 * MB, link_latency_s=2e-3),
           DeviceSpec("b", ram_bytes=0.1 * MB, disk_Bps=10 * MB, cpu_slowdown=2.0, link_Bps=50 * MB,
                      link_latency_s=2e-3)]
  windows = planner.split_windows((1, 1), 2)
  opts = DeviceOptions(prefetch=True, chunk_bytes=16 << 10)
  with RingEngine(files["q8_0"], windows, specs, opts) as ring:
    plain = generate.greedy(ring, PROMPT, 12)
    stats = ring.stats()
    assert all(s["clock"] == "emulated" for s in stats)
    assert stats[1]["emulated_disk_read_mb"] > 0  # b streams its windows from the emulated disk
    draft = generate.Draft(GGUFLlama(MappedGGUF(files["q4_0"])), ring)
    spec = generate.speculative(ring, draft, PROMPT, 12, gamma=3)
  assert spec.tokens == plain.tokens
  assert spec.steps < plain.steps and spec.accepted > 0


def test_speculative_equals_greedy_locally_with_poor_draft(files):
  # A draft from a different file (F16 vs Q4_0 target) disagrees often: output must still be identical.
  with RingEngine(files["q4_0"], [[list(range(4))]], [None]) as eng:
    plain = generate.greedy(eng, PROMPT, 20)
    for gamma in (1, 2, 5):
      draft = generate.Draft(GGUFLlama(MappedGGUF(files["f16"])), eng)
      assert generate.speculative(eng, draft, PROMPT, 20, gamma).tokens == plain.tokens


def test_prefetch_release_conflict_k1_reads_more_than_k2():
  """One device, share 4 MB, budget 3 MB: one big window prefetched whole evicts its own beginning;
  two 2 MB windows each fit, so every byte is read once per token."""
  def per_token_reads(k):
    c = EmulatedCache(3 * MB, 100 * MB, chunk=64 << 10)
    win = [(i * 4 * MB // k, (i + 1) * 4 * MB // k) for i in range(k)]
    t = 0.0
    for _ in range(3):  # warm up the steady state
      for i, (a, b) in enumerate(win):
        t = c.access(a, b, t) + 0.01
        c.release(a, b)
        c.prefetch(*win[(i + 1) % k], t)
    before = c.bytes_read
    for i, (a, b) in enumerate(win):
      t = c.access(a, b, t) + 0.01
      c.release(a, b)
      c.prefetch(*win[(i + 1) % k], t)
    return c.bytes_read - before
  assert per_token_reads(1) > per_token_reads(2) >= 4 * MB


def test_planner_halda_vs_baselines(files):
  info = read_info(files["q4_0"])
  lb = info.layer_bytes(0)
  head = sum(t.nbytes for n, t in info.tensors.items() if not n.startswith("blk."))
  # a and b each hold 2 of the 4 layers; streaming from their slow disks costs far more than a hop.
  specs = [DeviceSpec("a", ram_bytes=head + 2.5 * lb, disk_Bps=1 * MB, link_latency_s=1e-3),
           DeviceSpec("b", ram_bytes=2.5 * lb, disk_Bps=1 * MB, link_latency_s=1e-3),
           DeviceSpec("slow", ram_bytes=8 * MB, disk_Bps=50 * MB, cpu_slowdown=100.0, link_latency_s=1e-3)]
  # ctx=16: the KV cache (anonymous memory, charged against RAM) stays small next to the weights
  p, kept = planner.plan(info, specs, "halda", layer_s=1e-3, head_s=1e-4, ctx=16)
  assert [s.name for s in kept] == ["a", "b"]  # the 100x slower device is dropped
  assert sum(len(w) for dev in p.windows for w in dev) == 4
  pm, _ = planner.plan(info, specs, "memory", layer_s=1e-3)
  assert pm.k == 1 and [len(w[0]) for w in pm.windows][-1] == max(len(w[0]) for w in pm.windows)
