"""Halda MILP vs brute force on small instances, and its qualitative behaviour."""
import numpy as np
import pytest

from ondevice import halda

MB = 2**20


def _random_instance(rng, M, L):
  devs = []
  for m in range(M):
    gpu = rng.random() < 0.4
    devs.append(halda.DeviceCost(
        f"d{m}", t_cpu_layer_s=float(rng.uniform(1e-3, 8e-3)), ram_bytes=float(rng.uniform(0, 8) * MB),
        disk_Bps=float(rng.uniform(50, 400) * MB), t_gpu_layer_s=float(rng.uniform(2e-4, 1e-3)) if gpu else 0.0,
        vram_bytes=float(rng.uniform(0, 6) * MB) if gpu else 0.0, link_s=float(rng.uniform(0, 5e-3))))
  return devs, halda.ModelCost(L, layer_bytes=MB, kv_bytes_per_layer=MB // 8, head_s=1e-3)


@pytest.mark.parametrize("seed", range(12))
def test_milp_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  M, L = int(rng.integers(2, 4)), int(rng.choice([4, 6, 8]))
  devs, model = _random_instance(rng, M, L)
  for k in [k for k in range(1, L + 1) if L % k == 0]:
    plan = halda.solve_k(devs, model, k)
    bf, w, n = halda.brute_force(devs, model, k)
    assert plan is not None
    assert sum(plan.w) == L // k and all(nm <= wm for nm, wm in zip(plan.n, plan.w))
    assert plan.latency_s == pytest.approx(bf, rel=1e-6, abs=1e-9), (k, plan, w, n)


def test_model_that_fits_collapses_onto_the_head():
  fast = halda.DeviceCost("head", 1e-3, ram_bytes=100 * MB, disk_Bps=1e9, link_s=2e-3)
  others = [halda.DeviceCost(f"d{i}", 1e-3, ram_bytes=100 * MB, disk_Bps=1e9, link_s=2e-3) for i in range(3)]
  plan = halda.solve([fast] + others, halda.ModelCost(8, layer_bytes=MB))
  assert plan.w == (8, 0, 0, 0) and plan.used == (0,)


def test_slow_device_dropped_and_memory_short_model_spread():
  model = halda.ModelCost(16, layer_bytes=8 * MB)
  devs = [halda.DeviceCost("head", 2e-3, ram_bytes=40 * MB, disk_Bps=100 * MB),
          halda.DeviceCost("b", 2e-3, ram_bytes=60 * MB, disk_Bps=100 * MB, link_s=1e-3),
          halda.DeviceCost("slow", 0.5, ram_bytes=200 * MB, disk_Bps=100 * MB, link_s=1e-3)]
  plan = halda.solve(devs, model)
  assert plan.w[2] == 0, plan
  # Memory-short devices share the layers instead of the head streaming everything from disk.
  one = halda.evaluate(devs, model, 1, (16, 0, 0), (0, 0, 0))
  assert plan.latency_s < one


def test_gpu_takes_layers_within_vram():
  model = halda.ModelCost(8, layer_bytes=MB)
  d = halda.DeviceCost("g", 4e-3, ram_bytes=100 * MB, disk_Bps=1e9, t_gpu_layer_s=1e-4, vram_bytes=3 * MB)
  plan = halda.solve_k([d], model, 1)
  assert plan.n == (3,) and plan.w == (8,)


def test_windows_cover_all_layers_in_ring_order():
  plan = halda.Plan(k=2, w=(1, 2, 0), n=(0, 0, 0), latency_s=0.0, used=(0, 1))
  assert plan.windows() == [[[0], [3]], [[1, 2], [4, 5]], [[], []]]
  assert halda.memory_proportional([halda.DeviceCost("a", 1, 1, 1), halda.DeviceCost("b", 1, 3, 1)], 8) == (2, 6)


def test_overlap_makes_k_gt_1_win_when_memory_starved():
  """benchmarks/ondevice_devices4.yaml-like instance: 8 layers of 0.8 MB, RAM < one layer on two devices.
  Reads of k>1 windows overlap the other devices' work, so Halda picks k>1 although k=1 (pin what fits)
  reads fewer bytes; prima.cpp's cost, blind to the overlap, rates that plan far worse than it runs."""
  lb = int(0.8 * MB)
  spec = [(0.45, 7, 2.0), (0.9, 30, 1.0), (1.8, 32, 1.0), (0.5, 14, 3.0)]  # RAM MB, disk MB/s, slowdown
  devs = [halda.DeviceCost(f"d{i}", 5e-4 * sl, ram * MB, disk * MB, link_s=5e-3) for i, (ram, disk, sl) in
          enumerate(spec)]
  model = halda.ModelCost(8, lb, kv_bytes_per_layer=50_000, head_s=1e-3)
  best, k1 = halda.solve(devs, model), halda.solve_k(devs, model, 1)
  assert best.k > 1 and best.latency_s < 0.8 * k1.latency_s
  assert best.disk_bytes_per_token() > k1.disk_bytes_per_token()
  assert halda.prima_cost(devs, model, best.k, best.w, best.n) > 1.5 * best.latency_s
  assert halda.evaluate(devs, model, best.k, best.w, best.n) == pytest.approx(best.latency_s, rel=1e-6)
