"""Halda with MoE layers (ondevice/halda_moe.py): experts weighted by their activation frequency."""
import dataclasses
import json

import numpy as np
import pytest

from ondevice import gguf_io, halda, halda_moe, planner, testmodels
from ondevice.emulation import DeviceSpec

MB = 2**20
L, N, K = 4, 16, 2


@pytest.fixture(scope="module")
def info(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("hmoe") / "moe.gguf")
  testmodels.moe_gguf(path, "qwen3moe", "q8_0", n_layers=L, d_model=256, n_expert=N, n_used=K, ff=256, seed=2)
  return gguf_io.read_info(path)


def _skewed(seed=0, tokens=4000):
  """Routing counts with a few hot experts per layer (different ones per layer): rows sum to tokens * K."""
  rng = np.random.default_rng(seed)
  c = np.zeros((L, N))
  for i in range(L):
    p = rng.permutation(N)
    w = np.full(N, 0.2)
    w[p[:3]] = 6.0  # three hot experts
    for _ in range(tokens):
      c[i, rng.choice(N, K, replace=False, p=w / w.sum())] += 1
  return c


def _ring(info, ram_frac):
  """Two devices whose RAM holds the dense parts and ``ram_frac`` of the experts (so experts must be chosen)."""
  prof = halda_moe.profile(info)
  lb = planner.paged_layer_bytes(info)
  dense = lb - prof.layer_expert_bytes
  ram = (dense * L + ram_frac * prof.layer_expert_bytes * L) / 2
  return [DeviceSpec("a", ram_bytes=ram, disk_Bps=50 * MB, link_Bps=100 * MB),
          DeviceSpec("b", ram_bytes=ram, disk_Bps=50 * MB, link_Bps=100 * MB)]


def _plan(info, specs, counts=None, k="auto"):
  return planner.plan(info, specs, "halda", k, layer_s=1e-3, ctx=64, expert_counts=counts, drop_unused=False)[0]


def test_curve_is_the_hottest_first_read():
  """g(q) = max_i (a_i - s_i q) equals the expected read with the hottest experts resident, at and between
  whole experts, and is convex (each piece's slope is the next expert's frequency)."""
  f = np.array([[0.9, 0.05, 0.6, 0.45], [0.3, 0.2, 1.0, 0.5]])  # rows sum to 2 (top 2)
  p = halda_moe.ExpertProfile(f, 1000, "test")
  pieces = halda_moe.curve(p)
  mean = np.sort(f, axis=1)[:, ::-1].mean(0)
  for q in np.linspace(0, 4000, 17):
    full, part = int(q // 1000), q % 1000
    want = 1000 * mean[full + 1:].sum() + (mean[full] * (1000 - part) if full < 4 else 0.0)
    assert max(a - s * q for a, s in pieces) == pytest.approx(want, abs=1e-9), q
  assert halda_moe.curve(halda_moe.ExpertProfile(f[:, ::-1], 1000, "")) == pieces  # expert order is irrelevant


@pytest.mark.parametrize("counts", [None, "skewed"])
def test_milp_matches_one_device_optimum(info, counts):
  """One device, k = 1: the MILP's latency equals the closed-form optimum (RAM to the dense bytes, then to the
  hottest experts), for the uniform prior and for skewed measured frequencies."""
  prof = halda_moe.profile(info, _skewed() if counts else None)
  lb = planner.paged_layer_bytes(info)
  dense = lb - prof.layer_expert_bytes
  model = halda.ModelCost(L, lb, kv_bytes_per_layer=4096, expert_bytes=prof.layer_expert_bytes,
                          expert_curve=halda_moe.curve(prof))
  for frac in (0.0, 0.3, 0.7, 1.2):
    ram = dense * L + 4096 * L + frac * prof.layer_expert_bytes * L
    d = halda.DeviceCost("d", 2e-3, ram_bytes=ram, disk_Bps=40 * MB)
    plan = halda.solve_k([d], model, 1)
    want = halda_moe.one_device_latency(2e-3, ram, 40 * MB, L, dense, prof, kv_bytes=4096)
    assert plan.latency_s == pytest.approx(want, rel=1e-6), frac


def test_skewed_frequencies_keep_hot_experts_resident(info):
  """(a) Measured skewed routing: the resident experts are each layer's hottest, and the plan's expected disk
  bytes per token (under the measured frequencies) are below the frequency-blind plan's."""
  counts = _skewed()
  specs = _ring(info, 0.35)
  aware, blind = _plan(info, specs, counts), _plan(info, specs, None)
  prof = halda_moe.profile(info, counts)
  assert aware.experts["frequencies"].startswith("measured") and blind.experts["frequencies"].startswith("uniform")
  hot = {i: set(np.argsort(-counts[i], kind="stable")[:3].tolist()) for i in range(L)}
  resident = {}
  for dev in aware.experts["resident"]:
    for r in dev:
      for i, es in r.items():
        resident[i] = {e for e, b in es.items() if b >= prof.expert_bytes}
  assert resident and all(hot[i] <= es for i, es in resident.items()), (hot, resident)
  assert 0 < sum(len(es) for es in resident.values()) < L * N  # memory is short: some experts stay on disk
  cpu = lambda p: [[w[:len(w) - p.n_gpu[m]] for w in ws] for m, ws in enumerate(p.windows)]  # noqa: E731
  aware_read = halda_moe.expected_read(prof, cpu(aware), aware.experts["resident"])
  blind_read = halda_moe.expected_read(prof, cpu(blind), blind.experts["resident"])
  assert aware.experts["expert_read_mb_per_token"] * MB == pytest.approx(aware_read)
  assert aware_read < 0.7 * blind_read, (aware_read, blind_read)
  assert aware.model_latency_s < blind.model_latency_s
  # the control: the same plan's residency is worth nothing special under uniform frequencies
  uni = halda_moe.profile(info)
  assert halda_moe.expected_read(uni, cpu(aware), aware.experts["resident"]) == pytest.approx(
      halda_moe.expected_read(uni, cpu(blind), blind.experts["resident"]), rel=0.05)


def test_uniform_frequencies_reduce_to_the_prior_plan(info):
  """(b) Measured counts that are uniform give the frequency-blind plan (same windows, residency, latency)."""
  specs = _ring(info, 0.35)
  blind = _plan(info, specs, None)
  flat = _plan(info, specs, np.full((L, N), 250.0))
  assert flat.as_dict() == dict(blind.as_dict(), experts=dict(blind.as_dict()["experts"],
                                                               frequencies=flat.experts["frequencies"]))
  assert flat.experts["frequencies"].startswith("measured")


def test_dense_model_cost_unchanged():
  """Without experts the MILP is the dense one (a MoE curve of zero expert bytes adds nothing)."""
  devs = [halda.DeviceCost("a", 2e-3, 5 * MB, 30 * MB), halda.DeviceCost("b", 3e-3, 9 * MB, 60 * MB, link_s=1e-3)]
  model = halda.ModelCost(8, MB, kv_bytes_per_layer=10_000, head_s=1e-3)
  for k in (1, 2, 4):
    p = halda.solve_k(devs, model, k)
    assert p.expert_pin == () and p.latency_s == pytest.approx(halda.evaluate(devs, model, k, p.w, p.n), rel=1e-6)
  with pytest.raises(ValueError, match="dense layers"):
    halda.evaluate(devs, dataclasses.replace(model, expert_bytes=1), 1, (8, 0), (0, 0))


def test_counts_file_roundtrip_and_bad_files(info, tmp_path):
  c = _skewed(tokens=200)
  path = str(tmp_path / "counts.json")
  halda_moe.save_counts(path, info, c)
  np.testing.assert_array_equal(halda_moe.load_counts(path, info), c)
  bad = {"missing": None, "shape": {"counts": [[1, 2]]}, "negative": {"counts": (-c).tolist()}, "text": "x"}
  for name, body in bad.items():
    p = str(tmp_path / f"{name}.json")
    if body is not None:
      with open(p, "w") as f:
        f.write(body if isinstance(body, str) else json.dumps(body))
    with pytest.raises(ValueError, match="--save-expert-counts") as e:
      halda_moe.load_counts(p, info)
    assert "\n" not in str(e.value)


def test_cli_counts_plan_only_and_ring_refusal(info, tmp_path, capsys):
  """A one-device run saves its routing counts; --plan-only plans the ring with them; running MoE on the ring is
  refused in one line naming the fix."""
  from ondevice import run
  counts, devs = str(tmp_path / "c.json"), str(tmp_path / "d.yaml")
  with open(devs, "w") as f:
    f.write("devices:\n  - {name: a, ram_mb: 1.5, disk_mbps: 50}\n  - {name: b, ram_mb: 1.5, disk_mbps: 50}\n")
  m = ["--model", info.path]
  assert run.main(m + ["--prompt", "def f(x):", "--max-tokens", "8", "--save-expert-counts", counts]) == 0
  c = halda_moe.load_counts(counts, info)
  per = c.sum(axis=1)  # K per token and layer (the last layer of a prefill routes only the row whose logits count)
  assert per[0] > 8 * K and (per % K == 0).all() and (per[:-1] == per[0]).all()
  capsys.readouterr()
  assert run.main(m + ["--devices", devs, "--plan-only", "--expert-counts", counts]) == 0
  plan = json.loads(capsys.readouterr().out)
  assert plan["experts"]["frequencies"].startswith("measured") and sum(plan["w"]) * plan["k"] == L
  assert run.main(m + ["--devices", devs, "--prompt", "x"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: the ring does not run mixture-of-experts") and "\n" not in err
