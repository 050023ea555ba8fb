"""Compile for the target and price that executable (perfmodel/program.py target_train_step, route target_compile).

FLOPs of the graph built from TPU and GPU HLO are checked against framework.flops (the executed convention: remat
recompute, the flash kernels' causal block skipping) and against XLA:TPU's own cost analysis for a program without
loops; convolutions, unrolled loops and placed collectives against hand computations. The compile tests need the
tpu-aot extra (libtpu, the CUDA plugin) and skip, naming the install, without it.
"""
import dataclasses
import importlib.util
import math

import numpy as np
import pytest

from framework import config as config_lib
from framework import config_file, flops
from parallelism import targets
from perfmodel import predict, program
from perfmodel import target as target_lib
from perfmodel.cost import collectives as C
from perfmodel.cost import physical
from perfmodel.graph import from_hlo, hlo_parse as hp
from perfmodel.hardware import load
from tests.framework.tiny import tiny_config

HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA = importlib.util.find_spec("jax_plugins") is not None and \
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
NEEDS = {"tpu_v5p": pytest.mark.skipif(not HAS_TPU, reason=f"needs libtpu ({targets.INSTALL})"),
         "h100": pytest.mark.skipif(not HAS_CUDA, reason=f"needs the CUDA plugin ({targets.INSTALL})")}
# a tiny Llama in bf16 on 8 chips (data 8), each platform's flash kernel; 8 attention blocks per sequence, so the
# blocks a causal mask skips are close to half (splash skips whole 128-query blocks: 9/16 of them run)
TINY = ["--config.mesh.data=8", "--config.mesh.tensor=1", "--config.model.dtype=bfloat16",
        "--config.model.d_model=256", "--config.model.n_heads=2", "--config.model.n_kv_heads=2",
        "--config.model.head_dim=128", "--config.model.d_ff=512", "--config.data.seq_len=1024",
        "--config.model.max_seq_len=1024", "--config.model.attention_block=128", "--config.model.remat=full"]
KERNEL = {"tpu_v5p": "splash", "h100": "cudnn"}


def _cfg(hw: str, extra=()):
  cfg = config_file.load("experiments/configs/quickstart.py:runlocal=True",
                         TINY + [f"--config.model.attention={KERNEL[hw]}"] + list(extra))
  return config_lib.validate(cfg, 8)


@pytest.fixture(scope="module", params=[pytest.param(h, marks=NEEDS[h]) for h in ("tpu_v5p", "h100")])
def target(request):
  hw = request.param
  cfg = _cfg(hw)
  return hw, cfg, program.target_train_step(cfg, hw, keep_compiled=True)


def test_graph_flops_of_the_target_program_match_the_executed_count(target):
  hw, cfg, cap = target
  g = from_hlo.from_hlo_text(cap.hlo_text, cap.n_devices)
  dots = sum(n.flops * k for n, k in g.walk() if n.kind == "dot")
  m = cfg.model
  want = flops.train_flops_per_token(m, cfg.data.seq_len, causal_half=True, recompute="executed")
  want *= cfg.data.global_batch * cfg.data.seq_len / cap.n_devices
  # the flash kernels' backward recompute QK^T once more than framework.flops' kernel term (splash: dq and dkv each)
  attn = flops.attention_flops_per_token(m, cfg.data.seq_len, causal_half=True) / 2 * m.n_layers
  attn *= cfg.data.global_batch * cfg.data.seq_len / cap.n_devices
  extra = attn * (2 if hw.startswith("tpu") else 0)
  assert dots == pytest.approx(want + extra, rel=0.05), (dots, want, extra)
  kinds = {n.opcode for n, _ in g.walk() if n.opcode.startswith("custom-call")}
  assert any(("tpu_custom_call" if hw.startswith("tpu") else "cudnn") in k for k in kinds), kinds


def test_a_fused_attention_kernel_is_priced_by_its_published_curve(target):
  """cuDNN's flash-attention calls carry their kind (forward / backward, causal) and key/value length; the H100
  profile prices a large one at its published attention throughput at that length, below the GEMM curve's rate
  for the same FLOPs, and a small one no faster than a matmul of its FLOPs."""
  hw, cfg, cap = target
  g = from_hlo.from_hlo_text(cap.hlo_text, cap.n_devices)
  kernels = {(n.dot.kernel, n.dot.seq) for n, _ in g.walk() if n.dot is not None and n.dot.kernel}
  if hw.startswith("tpu"):  # splash kernels: no published attention curve, priced as matmuls of their FLOPs
    assert kernels == set() and not any("attention" in k for k in load(hw).efficiency), kernels
    return
  assert kernels == {("attention_fwd_causal", 1024), ("attention_bwd_causal", 1024)}, kernels
  prof = load(hw)
  eff = physical.Efficiency(prof)
  small = next(n for n, _ in g.walk() if n.dot is not None and n.dot.kernel == "attention_fwd_causal")
  as_gemm = dataclasses.replace(small, dot=dataclasses.replace(small.dot, kernel=""))
  assert eff.price(small).seconds == eff.price(as_gemm).seconds
  big = dataclasses.replace(small, flops=2e12, bytes=1e6, dot=dataclasses.replace(small.dot, seq=4096))
  frac = dict(prof.efficiency["attention_fwd_causal"]["value"])[4096]
  assert eff.price(big).seconds == pytest.approx(2e12 / (prof.peak("bf16") * frac))
  big_gemm = dataclasses.replace(big, dot=dataclasses.replace(big.dot, kernel=""))
  assert eff.price(big).seconds > 1.3 * eff.price(big_gemm).seconds


def test_predict_on_the_target_prices_it_and_reports_the_compilers_memory(target):
  hw, cfg, cap = target
  p = predict.predict(cfg, hw, captured=cap)
  compiled, _ = cap.compiled
  assert p.route == "target_compile" and p.backends == ["efficiency"]
  assert math.isfinite(p.step_time_s) and p.step_time_s > 0 and 0 < p.mfu < 1
  assert p.peak_memory_bytes == targets.compiled_memory(compiled)["peak"] > 0
  assert p.breakdown["priced_by"]["efficiency"] > 0
  if hw.startswith("tpu"):  # the v5p profile publishes no matmul or HBM sweep: said, not hidden
    assert any("matmul efficiency" in a for a in p.assumptions) and any("HBM" in a for a in p.assumptions)


@NEEDS["tpu_v5p"]
def test_tpu_graph_flops_equal_xla_cost_analysis_without_loops():
  cfg = _cfg("tpu_v5p", ["--config.model.scan_layers=False", "--config.model.remat=none",
                         "--config.model.attention=dense"])
  cap = program.target_train_step(cfg, "tpu_v5p")
  g = from_hlo.from_hlo_text(cap.hlo_text, cap.n_devices)
  assert not any(n.kind == "loop" and n.opcode == "while" for n, _ in g.walk())
  dots = sum(n.flops for n, _ in g.walk() if n.kind == "dot")
  assert dots == pytest.approx(cap.cost_analysis["flops"], rel=0.05)


def _conv_module(window: str, labels: str, lhs: str, rhs: str, out: str) -> hp.Module:
  return hp.parse_module(f"""HloModule m
ENTRY %main (a: {lhs}, b: {rhs}) -> {out} {{
  %a = {lhs} parameter(0)
  %b = {rhs} parameter(1)
  ROOT %c = {out} convolution(%a, %b), window={{{window}}}, dim_labels={labels}
}}
""")


def _brute(in_size, out_size, size, stride, lo, ldil, rdil):
  return sum(1 for o in range(out_size) for w in range(size)
             if (p := o * stride + w * rdil - lo) >= 0 and p % ldil == 0 and p // ldil < in_size)


def test_convolution_flops_from_dim_labels_and_window():
  # a matmul as XLA:TPU writes it: no spatial window, 2 x batch x out features x in features
  m = _conv_module("size=1", "0bf_io0->0bf", "bf16[8,128,256]", "bf16[256,32,1]", "f32[8,128,32]")
  f, d = from_hlo.conv_info(m.entry_computation.root, m.entry_computation)
  assert f == 2 * 8 * 128 * 32 * 256 and d.in_dtype == "bf16" and d.n == 32
  # a padded, strided, base-dilated window: only taps on real input elements count (HloCostAnalysis)
  m = _conv_module("size=8x2 stride=7x1 pad=0_0x1_1 lhs_dilate=8x1", "0bf1_0o1i->0bf1", "bf16[8,4,16,1]",
                   "bf16[8,16,2,2]", "f32[8,4,16,2]")
  f, _ = from_hlo.conv_info(m.entry_computation.root, m.entry_computation)
  taps = _brute(8, 8, 8, 7, 0, 8, 1) * _brute(1, 2, 2, 1, 1, 1, 1)
  assert taps < 8 * 8 * 2 * 2  # the dilation holes and the padding are not work
  assert f == 2 * 4 * 16 * 2 * taps


def test_trip_count_of_a_loop_that_steps_by_two():
  # XLA:TPU's unrolled windowed-einsum loops: `i < 4` with i += 2 runs twice
  m = hp.parse_module("""HloModule m
%cond (p: (u32[], f32[4])) -> pred[] {
  %p = (u32[], f32[4]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %n = u32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
%body (q: (u32[], f32[4])) -> (u32[], f32[4]) {
  %q = (u32[], f32[4]) parameter(0)
  %j = u32[] get-tuple-element(%q), index=0
  %x = f32[4] get-tuple-element(%q), index=1
  %two = u32[] constant(2)
  %k = u32[] add(%j, %two)
  %y = f32[4] add(%x, %x)
  ROOT %t = (u32[], f32[4]) tuple(%k, %y)
}
ENTRY %main (a: f32[4]) -> (u32[], f32[4]) {
  %a = f32[4] parameter(0)
  %z = u32[] constant(0)
  %init = (u32[], f32[4]) tuple(%z, %a)
  ROOT %w = (u32[], f32[4]) while(%init), condition=%cond, body=%body
}
""")
  assert hp.trip_count(m, m.entry_computation.root) == 2


def test_placed_collectives_ride_the_torus_axes_the_group_spans():
  hw = load("tpu_v5p")
  ici = hw.links[0]
  shape, wrap = (4, 4, 4), targets.wraparound("tpu_v5p", (4, 4, 4))
  coords = tuple((0, x, y, z) for z in range(4) for y in range(4) for x in range(4))
  pl = C.Placement(coords, shape, wrap)
  S = 1 << 30
  one_axis = C.placed_cost("all-gather", S, tuple(range(4)), hw, pl).seconds  # x varies: one wrapped ring
  two_axes = C.placed_cost("all-gather", S, tuple(range(16)), hw, pl).seconds  # x and y
  eff = min(1.0, C._curve(hw, "collectives", "collective-permute", ici)(S / 4) / ici.bandwidth)
  assert one_axis == pytest.approx(3 / 4 * S / (2 * ici.bandwidth * eff) + 3 * ici.latency)
  assert two_axes < one_axis  # twice the links, more data each: (15/16) / 4 links vs (3/4) / 2
  # a 2x2x1 slice has no wraparound: one direction per axis
  assert targets.wraparound("tpu_v5p", (2, 2, 1)) == (False, False, False)


def test_placed_collectives_cross_gpu_nodes_hierarchically():
  hw = load("h100")
  pl = C.Placement(tuple((i // 8, i % 8) for i in range(32)))
  S = 256 << 20
  inside = C.placed_cost("all-reduce", S, tuple(range(8)), hw, pl)
  busbw = np.interp(np.log(S), *zip(*[(np.log(x), y) for x, y in hw.efficiency["collectives"]["all-reduce"]["value"]]))
  assert inside.seconds == pytest.approx(2 * 7 / 8 * S / busbw, rel=1e-6)
  across = C.placed_cost("all-reduce", S, tuple(range(32)), hw, pl)
  assert across.algorithm == "placed-hierarchical" and across.seconds > inside.seconds


def test_a_collective_below_the_measured_sizes_costs_its_latency():
  """A scalar all-reduce in one NVLink node pays the ring's 2(n-1) link latencies (NCCL's time is flat below
  ~1 KiB), not the smallest measured size's busbw applied to 4 bytes; a large one is priced by the curve."""
  hw = load("h100")
  nvl = hw.links[0]
  pl = C.Placement(tuple((0, i) for i in range(8)))
  assert C.placed_cost("all-reduce", 4, tuple(range(8)), hw, pl).seconds == pytest.approx(14 * nvl.latency)
  assert C.placed_cost("all-gather", 4, tuple(range(8)), hw, pl).seconds == pytest.approx(7 * nvl.latency)
  S = 256 << 20
  busbw = np.interp(np.log(S), *zip(*[(np.log(x), y) for x, y in hw.efficiency["collectives"]["all-reduce"]["value"]]))
  assert C.placed_cost("all-reduce", S, tuple(range(8)), hw, pl).seconds == pytest.approx(2 * 7 / 8 * S / busbw)


def test_a_small_all_reduce_across_many_gpu_nodes_is_priced_as_a_tree():
  """NCCL's tuner runs a latency-bound all-reduce over hundreds of nodes as a double binary tree (2 log2 n
  hops of the fabric), not as a ring (2(n-1) hops); the placed cost takes the faster of the two."""
  hw = load("h100")
  ib = hw.links[1]
  pl = C.Placement(tuple((i // 8, i % 8) for i in range(2048)))
  group = tuple(range(0, 2048, 8))  # one device in each of 256 nodes
  scalar = C.placed_cost("all-reduce", 4, group, hw, pl).seconds
  assert scalar < 2 * 255 * ib.latency / 10  # a ring would pay 510 hops
  assert scalar >= 2 * 8 * ib.latency  # a tree pays 2 log2(256)
  big = 1 << 30  # bandwidth-bound either way: never above the ring, never below the ring's bandwidth term
  t = C.placed_cost("all-reduce", big, group, hw, pl).seconds
  assert 2 * 255 / 256 * big / ib.bandwidth <= t <= C.ring_all_reduce(big, 256, ib.bandwidth, ib.latency)


def test_an_all_to_all_across_gpu_nodes_sends_only_the_other_nodes_blocks_over_the_fabric():
  """Expert-parallel dispatch over 2 nodes of 8: each GPU sends half its buffer to its own node's peers over
  NVLink and half over its NIC, at once; the fabric's share, not the whole buffer, sets the time."""
  hw = load("h100")
  ib = hw.links[1]
  pl = C.Placement(tuple((i // 8, i % 8) for i in range(16)))
  S = 128 << 20
  t = C.placed_cost("all-to-all", S, tuple(range(16)), hw, pl).seconds
  assert t == pytest.approx(S * 8 / 16 / ib.bandwidth + 8 * ib.latency)
  # four peers per node (tensor-parallel pairs in between): three quarters of the buffer leave the node
  quarter = C.placed_cost("all-to-all", S, tuple(range(0, 32, 2)), hw, C.Placement(
      tuple((i // 8, i % 8) for i in range(32)))).seconds
  assert quarter == pytest.approx(S * 12 / 16 / ib.bandwidth + 12 * ib.latency)


def test_a_compile_that_outgrows_the_host_is_stopped_with_one_line(monkeypatch):
  """The compile child is watched: past the host-memory limit it is killed and the error says so (never the
  kernel's OOM killer)."""
  monkeypatch.setattr(target_lib, "_host_memory_limit", lambda: 1)  # any resident byte is too many
  cfg = config_lib.validate(tiny_config(mesh=dict(data=8)), 8)
  with pytest.raises(target_lib.HostMemoryError, match="needs more than .* of this host's memory"):
    target_lib.train_step(cfg, "h100", cache=False)


def test_a_frameworks_xla_flags_are_part_of_the_program_cache_key():
  """The flags change the compiled program, so they key the cache; the compiler's defaults keep the plain key."""
  cfg = _cfg("h100")
  plain = target_lib.key(cfg, "h100")
  assert target_lib.key(cfg, "h100", framework=None) == plain
  assert target_lib.key(cfg, "h100", framework="maxtext") != plain
  assert target_lib.key(cfg, "h100", framework="maxtext") != target_lib.key(cfg, "h100", framework="paxml")
  assert target_lib.key(cfg, "tpu_v6e", framework="maxtext") == target_lib.key(cfg, "tpu_v6e")  # none published


def test_predict_applies_a_frameworks_overlap_options_to_the_target_program(target):
  """The Megatron row's options reach the timeline with their windows and bucket; PrismLLM's own step has none."""
  hw, cfg, cap = target
  base = predict.predict(cfg, hw, captured=cap)
  meg = predict.predict(cfg, hw, captured=cap, framework="Megatron-Core r0.8.0")
  assert base.overlap is None
  assert meg.overlap["options"] == ["tp_comm", "grad_reduce", "param_gather"]
  assert meg.overlap["bwd_window_s"] > 0 and meg.overlap["fwd_window_s"] > 0
  local = cfg.model.n_params(embeddings=True) / (cfg.mesh.tensor * cfg.mesh.pipeline)
  assert meg.overlap["bucket_fraction"] == pytest.approx(min(1.0, max(40e6, 1e6 * 8) / local))


@NEEDS["h100"]
def test_gpu_ring_attention_runs_cudnn_flash_blocks():
  """Context parallelism on a GPU target: every ring block is a cuDNN fused attention call, forward and backward
  (framework/ring_cudnn.py), not XLA fusions that build each block's scores."""
  cfg = _cfg("h100", ["--config.mesh.data=4", "--config.mesh.sequence=2", "--config.mesh.form=shard_map",
                      "--config.model.attention=ring"])
  cap = program.target_train_step(cfg, "h100")
  calls = [ln.split('custom_call_target="')[1].split('"')[0] for ln in cap.hlo_text.splitlines()
           if 'custom_call_target="' in ln]
  assert "__cudnn$fmhaSoftmax" in calls and "__cudnn$fmhaSoftmaxBackward" in calls, calls


def test_the_program_cache_digest_covers_every_module_a_step_is_built_from():
  """A change to any framework / parallelism module that build_step imports (directly or through another one)
  must make cached programs stale, so each such module is in the digest's source list."""
  import ast
  import os
  root = target_lib.ROOT

  def local_imports(rel):
    tree = ast.parse(open(os.path.join(root, rel)).read())
    out = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module in ("framework", "parallelism"):
        out |= {f"{node.module}/{a.name}.py" for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("framework",
                                                                                             "parallelism"):
        out.add(node.module.replace(".", "/") + ".py")
    return {r for r in out if os.path.isfile(os.path.join(root, r))}

  seen, todo = set(), ["parallelism/step.py"]
  while todo:
    rel = todo.pop()
    if rel not in seen:
      seen.add(rel)
      todo.extend(local_imports(rel))
  missing = sorted(seen - set(target_lib._SOURCES))
  assert not missing, f"modules a compiled step is built from but not in perfmodel.target._SOURCES: {missing}"
