"""A device executing Halda's residency plan reads from disk what Halda's cost model says, stays inside its
memory budget, and avoids the prefetch-release conflict that prima.cpp's whole-window prefetch runs into."""
import numpy as np
import pytest

from ondevice import halda, planner
from ondevice.device import Device, DeviceOptions
from ondevice.emulation import DeviceSpec, EmulatedCache
from ondevice.gguf_io import read_info

MB = 2**20
PAGE = 4096


def _steady_reads_per_token(dev, n_tokens=3):
  """Drives one device through its k windows as the ring would (recv -> run -> send -> after_send)."""
  x = np.zeros((1, dev.mapped.info.cfg.d_model), np.float32)
  k = len(dev.windows)
  reads = []
  for tok in range(n_tokens + 1):
    before = dev.ecache.bytes_read
    for c in range(k):
      dev.run_window(c, x, tok, dev.clock.now + 0.05)  # the rest of the ring takes 50 ms (emulated)
      dev.after_send(c)
    reads.append(dev.ecache.bytes_read - before)
  return reads[1:]  # the first token also loads the pinned part


@pytest.mark.parametrize("k", [1, 2, 4])
def test_halda_residency_reads_what_the_model_says(files, k):
  info = read_info(files["q8_0"])
  L, ctx = info.cfg.n_layers, 16
  lb = planner.paged_layer_bytes(info)
  kv = L * 2 * ctx * info.cfg.n_kv_heads * info.cfg.hd * 4
  # one device holding all 4 layers with room for ~1.6 of them: memory-short
  spec = DeviceSpec("d", ram_bytes=1.6 * lb + kv, disk_Bps=50 * MB)
  _, model = planner.costs(info, [spec], layer_s=1e-4, head_s=0.0, ctx=ctx)
  devs = [halda.DeviceCost("d", 1e-4, spec.ram_bytes, spec.disk_Bps)]  # a worker: no embedding/output held
  hp = halda.solve_k(devs, model, k)
  assert hp.w == (L // k,)
  res = (hp.pin[0], hp.prefetch[0])
  dev = Device(files["q8_0"], hp.windows()[0], spec, DeviceOptions(policy="plan", chunk_bytes=PAGE, max_len=ctx),
               residency=res)
  modelled = hp.disk_bytes_per_token()
  got = _steady_reads_per_token(dev)
  # exact up to one page per window boundary (the plan is rounded down to pages)
  assert all(abs(g - modelled) <= 3 * k * PAGE for g in got), (got, modelled, res)
  assert dev.ecache.resident_bytes() <= dev.ecache.budget
  assert modelled >= 4 * lb - 1.6 * lb - PAGE * 4  # cannot read less than what does not fit


def test_whole_window_prefetch_of_an_oversized_window_reads_it_twice(files):
  """prima.cpp's runtime at k=1 (prefetch the whole next window, LRU): the window is larger than RAM, so
  the read-ahead evicts its own beginning before use and everything is read about twice per token."""
  info = read_info(files["q8_0"])
  ctx = 16
  lb = planner.paged_layer_bytes(info)
  kv = 4 * 2 * ctx * info.cfg.n_kv_heads * info.cfg.hd * 4
  spec = DeviceSpec("d", ram_bytes=2.5 * lb + kv, disk_Bps=50 * MB)
  prima = Device(files["q8_0"], [[0, 1, 2, 3]], spec, DeviceOptions(policy="os", prefetch=True, chunk_bytes=PAGE,
                                                                     max_len=ctx))
  pinned = Device(files["q8_0"], [[0, 1, 2, 3]], spec, DeviceOptions(policy="plan", chunk_bytes=PAGE, max_len=ctx))
  a, b = pinned.cpu_ranges[0]
  share = b - a
  r_prima, r_pin = _steady_reads_per_token(prima)[-1], _steady_reads_per_token(pinned)[-1]
  assert r_prima >= 1.8 * share
  assert abs(r_pin - (share - 2.5 * lb)) <= 2 * PAGE  # pin what fits (in whole pages), fault the rest once
  # k = 2 windows under the same prima runtime: each fits, so each byte is read once
  prima2 = Device(files["q8_0"], [[0, 1], [2, 3]], spec, DeviceOptions(policy="os", prefetch=True,
                                                                        chunk_bytes=PAGE, max_len=ctx))
  r2 = _steady_reads_per_token(prima2)[-1]
  assert r2 < r_prima and r2 <= share + 2 * PAGE


def test_emulated_cache_pins_and_streams():
  c = EmulatedCache(10 * PAGE, disk_Bps=PAGE * 100, chunk=PAGE)
  c.access(0, 4 * PAGE, 0.0, "pin")
  c.access(100 * PAGE, 120 * PAGE, 0.0, "lru")  # 20 pages through a 6-page LRU: pins survive
  assert len(c.pinned) == 4 and c.resident_bytes() == 10 * PAGE
  before = c.bytes_read
  t = c.access(200 * PAGE, 203 * PAGE, 1.0, "stream")
  assert c.bytes_read - before == 3 * PAGE and 203 not in c.ready_at and t >= 1.0 + 3 / 100
  c.access(0, 4 * PAGE, 2.0)  # pinned: no reads
  assert c.bytes_read - before == 3 * PAGE
