"""Compiling the real training step for TPU pods and GPU clusters on this host (parallelism/targets.py).

The planning and error tests need nothing extra. The compile tests need the ``tpu-aot`` extra (libtpu and
the CUDA plugin: part of ``.[test]``) and skip, naming the install, only when it is absent. They compile
``parallelism.step.build_step`` with XLA's optimisations on (the parallelism package turns most of them off
for its equivalence tests): the program is the one the target would run.
"""
import importlib.util
import math
import re
import sys
import time

import jax
import pytest

from framework import config_file
from framework import config as config_lib
from framework.config import MeshConfig
from parallelism import step as step_lib
from parallelism import targets

HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA = importlib.util.find_spec("jax_plugins") is not None and \
    importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
_WHY = f"the tpu-aot extra is not installed ({targets.INSTALL})"
needs_tpu = pytest.mark.skipif(not HAS_TPU, reason=_WHY)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason=_WHY)
needs = {"tpu_v4": needs_tpu, "tpu_v5p": needs_tpu, "tpu_v5e": needs_tpu, "tpu_v6e": needs_tpu,
         "a100": needs_cuda, "h100": needs_cuda, "h200": needs_cuda}

QUICKSTART = "experiments/configs/quickstart.py:runlocal=True"
FSDP8 = ["--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.mesh.tensor=1"]
# Every matrix shard is whole (8, 128) TPU tiles at fsdp=8 (d_model/8 = 128 lanes; head_dim 128), so the
# TPU's per-chip argument bytes are the hand count, not the hand count plus tile padding.
ALIGNED = FSDP8 + ["--config.model.d_model=1024", "--config.model.n_heads=8", "--config.model.n_kv_heads=8",
                   "--config.model.d_ff=1024"]
HBM_BYTES = {"tpu_v5p": 95 * 2**30, "h100": 80 * 2**30}  # Cloud TPU v5p page; H100 SXM datasheet


@pytest.fixture(scope="module", autouse=True)
def _optimised_compiles():
  """The target's real program: tests/parallelism/conftest.py turns most XLA optimisations off for the
  whole package, which would compile a different (unfused, unscheduled) program. Restored afterwards."""
  old = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", old)


# ------------------------------------------------------------------------------------------ planning


@pytest.mark.parametrize("hardware,n,topology,slices,hosts", [
    ("tpu_v5p", 4, "2x2x1", 1, (2, 2, 1)),
    ("tpu_v5p", 8, "2x2x2", 1, (2, 2, 1)),
    ("tpu_v5p", 32, "2x4x4", 1, (2, 2, 1)),
    ("tpu_v5p", 128, "4x4x8", 1, (2, 2, 1)),  # Cloud TPU's default shapes per chip count
    ("tpu_v5p", 384, "4x8x12", 1, (2, 2, 1)),
    ("tpu_v5p", 768, "8x8x12", 1, (2, 2, 1)),
    ("tpu_v5p", 6144, "16x16x24", 1, (2, 2, 1)),  # the largest v5p slice
    ("tpu_v5p", 12288, "16x16x24", 2, (2, 2, 1)),  # beyond it: slices over the data-center network
    ("tpu_v4", 4096, "16x16x16", 1, (2, 2, 1)),
    ("tpu_v5e", 1, "1x1", 1, (1, 1, 1)),
    ("tpu_v5e", 8, "2x4", 1, (2, 4, 1)),
    ("tpu_v6e", 256, "16x16", 1, (2, 2, 1)),
    ("tpu_v6e", 1024, "16x16", 4, (2, 2, 1)),
    ("h100", 4, "1x1x4", 1, ()),
    ("h100", 8, "1x1x8", 1, ()),
    ("a100", 1024, "128x1x8", 1, ()),  # one NVLink domain per 8-GPU node
])
def test_plan_shapes(hardware, n, topology, slices, hosts):
  t = targets.plan(hardware, n)
  assert (t.topology, t.num_slices, t.chips_per_host) == (topology, slices, hosts)
  per_slice = math.prod(int(s) for s in topology.split("x"))
  assert per_slice * slices == n


def test_plan_explicit_topology():
  assert targets.plan("tpu_v5p", 16, "v5p:2x2x2").num_slices == 2
  assert targets.plan("tpu_v5p", 256, "4x8x8").topology == "4x8x8"
  assert targets.plan("h100", 16, "1x2x8").topology == "1x2x8"


@pytest.mark.parametrize("hardware,n,topology,fix", [
    ("tpu_v5p", 6, None, "4, 8, 16, 32 or a multiple of 64 up to 6144"),
    ("tpu_v5p", 96, None, "a multiple of 64"),
    ("tpu_v5e", 12, None, "1, 4, 8, 16, 32, 64, 128, 256"),
    ("h100", 12, None, "multiple of 8"),
    ("tpu_v9", 8, None, "tpu_v4, tpu_v5p, tpu_v5e, tpu_v6e, a100, h100, h200"),
    ("tpu_v5p", 0, None, ">= 1"),
    ("tpu_v5p", 27, "3x3x3", "has no 3x3x3 slice"),
    ("tpu_v5p", 24, "2x2x4", "use a multiple of 16"),
    ("tpu_v5e", 8, "2x2x2", "AxB like 4x8"),
    ("h100", 16, "2x8", "PxHxD"),
    ("h100", 16, "1x1x8", "P*H*D = 16"),
    ("tpu_v5p", 8, "v4:2x2x2", "another system"),
])
def test_plan_errors_name_the_fix(hardware, n, topology, fix):
  with pytest.raises(targets.TargetError) as e:
    targets.plan(hardware, n, topology)
  assert fix in str(e.value) and "\n" not in str(e.value)


def test_mesh_with_free_axis_needs_a_topology():
  with pytest.raises(targets.TargetError, match="give a topology"):
    targets.target_mesh(MeshConfig(data=-1), "tpu_v5p")


def test_missing_packages_name_the_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "libtpu", None)  # None in sys.modules: `import libtpu` raises
  with pytest.raises(targets.TargetError, match=re.escape(targets.INSTALL)):
    targets._tpu_devices(targets.plan("tpu_v6e", 4))
  monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda12", None)
  with pytest.raises(targets.TargetError, match=re.escape(targets.INSTALL)):
    targets._gpu_devices(targets.plan("a100", 2))


@pytest.mark.parametrize("hardware,fp32_tflops", [("a100", 19.5), ("h100", 67), ("h200", 67)])
def test_gpu_spec_numbers_agree_with_the_datasheet_fp32_rate(hardware, fp32_tflops):
  # SMs x FP32 lanes x 2 FLOP x clock must give the datasheet's FP32 rate: a mistyped SM count, lane
  # count or clock in the spec file breaks the product.
  text = targets.gpu_target_config(hardware)
  field = lambda k: float(re.search(rf"^\s*{k}: ([\d.]+)", text, re.M).group(1))  # noqa: E731
  rate = field("core_count") * field("fpus_per_core") * 2 * field("clock_rate_ghz") * 1e9
  assert rate == pytest.approx(fp32_tflops * 1e12, rel=0.01)


# -------------------------------------------------------------------------------- compile-only devices


@pytest.mark.parametrize("hardware,kind", [pytest.param(h, k, marks=needs[h]) for h, k in [
    ("tpu_v4", "TPU v4"), ("tpu_v5p", "TPU v5"), ("tpu_v5e", "TPU v5 lite"), ("tpu_v6e", "TPU v6 lite"),
    ("a100", "NVIDIA A100-SXM4-80GB"), ("h100", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200")]])
def test_devices_are_the_target_chips(hardware, kind):
  devices = targets.compile_only_devices(hardware, 8)
  assert len(devices) == 8 and len({d.id for d in devices}) == 8
  assert {d.device_kind for d in devices} == {kind}
  assert devices == targets.compile_only_devices(hardware, 8)  # cached: the same device objects


@needs_cuda
@pytest.mark.parametrize("hardware,fp8_gemms", [("h100", 2), ("a100", 0)])
def test_fp8_dots_become_cublaslt_fp8_gemms_on_hopper(hardware, fp8_gemms):
  # Both gradients of a scaled fp8 dot (e5m2 gradient x e4m3 operand) must compile to cuBLASLt fp8 GEMMs on
  # H100, as on a real machine with this plugin: without the CUDA runtime version in the target description
  # XLA widens the operands to bf16 instead. A100 has no fp8 tensor cores: bf16 GEMMs there.
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import SingleDeviceSharding  # noqa: PLC0415
  from framework import fp8  # noqa: PLC0415
  x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16,
                           sharding=SingleDeviceSharding(targets.compile_only_devices(hardware, 1)[0]))
  grads = jax.grad(lambda a, b: fp8.dot_general(a, b, (((1,), (0,)), ((), ()))).astype(jnp.float32).sum(), (0, 1))
  with targets.trace_context(hardware):
    hlo = jax.jit(grads).lower(x, x).compile(compiler_options={"xla_gpu_enable_triton_gemm": False}).as_text()
  calls = re.findall(r'custom_call_target="(__cublas[^"]*)"', hlo)
  assert calls.count("__cublas$lt$matmul$f8") == fp8_gemms and len(calls) == 2, calls


# ------------------------------------------------------------------------------- the real step, compiled


def _compile(hardware: str, overrides, topology=None):
  cfg = config_file.load(QUICKSTART, overrides)
  mesh = targets.target_mesh(cfg.mesh, hardware, topology)
  cfg = config_lib.validate(cfg, mesh.size)
  t0 = time.perf_counter()
  st = step_lib.build_step(cfg, mesh)
  compiled = st.lower().compile()
  return cfg, st, compiled, time.perf_counter() - t0


def _shard_bytes(tree) -> int:
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _hand_argument_bytes(cfg) -> int:
  """Per-chip bytes of the step's inputs from the model's shape alone: every matrix is split over fsdp,
  the RMSNorm scales are replicated, and the state is f32 parameters plus Adam's two moments."""
  m, fsdp = cfg.model, cfg.mesh.fsdp
  d, h, kv, hd, f, v, layers = m.d_model, m.n_heads, m.n_kv_heads, m.hd, m.ff, m.vocab_size, m.n_layers
  sharded = 2 * v * d + layers * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f)
  replicated = layers * 2 * d + d
  assert sharded + replicated == m.n_params()
  state = 3 * 4 * (sharded // fsdp + replicated)
  batch = 2 * 4 * cfg.data.global_batch * cfg.data.seq_len // fsdp  # int32 inputs and targets
  return state + batch


def _assert_target_hlo(hw: str, hlo: str):
  assert re.search(r" all-gather(-start)?\(", hlo), "FSDP gathers its parameter shards"
  if hw.startswith("tpu"):
    assert ":T(8,128)" in hlo  # TPU tiled layouts: (8 sublanes, 128 lanes)
    assert re.search(r"convolution\(", hlo) and "kind=kOutput" in hlo  # matmuls as MXU convolution fusions
    assert "__triton" not in hlo
  else:
    assert "__triton" in hlo  # matmuls as Triton GEMM fusions
    assert re.search(r"(all-gather|reduce-scatter|all-reduce)-start\(", hlo)  # async NCCL collectives
    assert ":T(" not in hlo


# One test per target (not one per fact) so that pytest-xdist compiles each program once.
@pytest.mark.parametrize("hw", [pytest.param(h, marks=needs[h]) for h in ("tpu_v5p", "h100")])
def test_step_compiles_for_target(hw):
  cfg, st, compiled, seconds = _compile(hw, ALIGNED)
  print(f"\n{hw}: compiled the 8-chip FSDP step in {seconds:.1f} s")
  assert {d.platform for d in st.mesh.devices.flat} == {"tpu" if hw.startswith("tpu") else "gpu"}
  _assert_target_hlo(hw, compiled.as_text())

  mem = targets.compiled_memory(compiled)
  assert mem["argument"] == pytest.approx(_hand_argument_bytes(cfg), rel=0.01)
  shard_bytes = _shard_bytes((st.abstract_state(), st.abstract_batch()))
  if hw.startswith("tpu"):
    assert shard_bytes <= mem["argument"] <= 1.01 * shard_bytes  # only tile padding on top
  else:
    assert mem["argument"] == shard_bytes  # GPU buffers are the shards, byte for byte
  assert mem["alias"] >= _shard_bytes(st.abstract_state())  # the donated state is updated in place
  assert mem["temp"] > 0 and mem["peak_source"] == "xla"
  assert mem["argument"] <= mem["peak"] <= mem["needed"] < HBM_BYTES[hw]


DATA2_FSDP8 = ["--config.mesh.data=2", "--config.mesh.fsdp=8", "--config.mesh.tensor=1",
               "--config.data.global_batch=16"]


@needs_tpu
def test_multislice_mesh_puts_slices_on_the_outer_axis():
  cfg, _, compiled, _ = _compile("tpu_v5p", DATA2_FSDP8, topology="2x2x2")
  mesh = targets.target_mesh(cfg.mesh, "tpu_v5p", "2x2x2")
  slices = [[d.slice_index for d in row.flat] for row in mesh.devices.reshape(2, 8)]
  assert slices == [[0] * 8, [1] * 8]  # data-parallel over the data-center network, FSDP inside a slice
  assert targets.compiled_memory(compiled)["argument"] > 0


@needs_cuda
def test_two_h100_nodes():
  cfg, _, compiled, _ = _compile("h100", DATA2_FSDP8)
  mesh = targets.target_mesh(cfg.mesh, "h100")
  hosts = [{d.process_index for d in row.flat} for row in mesh.devices.reshape(2, 8)]
  assert hosts == [{0}, {1}]  # FSDP inside a node (NVLink), data-parallel across the two
  assert "__triton" in compiled.as_text()


# ------------------------------------------------------------------------ Llama-3-8B width, two layers

LLAMA3_8B_WIDTH = FSDP8 + [
    "--config.model.vocab_size=128256", "--config.model.d_model=4096", "--config.model.n_heads=32",
    "--config.model.n_kv_heads=8", "--config.model.d_ff=14336", "--config.model.n_layers=2",
    "--config.model.max_seq_len=4096", "--config.model.rope_theta=500000.0", "--config.model.dtype=bfloat16",
    "--config.model.remat=full", "--config.data.seq_len=4096", "--config.data.global_batch=8"]


@pytest.mark.slow
@pytest.mark.parametrize("hardware", [pytest.param(h, marks=needs[h]) for h in ("tpu_v5p", "h100")])
def test_llama3_8b_width_two_layers(hardware):
  cfg, _, compiled, seconds = _compile(hardware, LLAMA3_8B_WIDTH)
  mem = targets.compiled_memory(compiled)
  print(f"\n{hardware} Llama-3-8B width, 2 layers, fsdp=8: compile {seconds:.1f} s, memory {mem}")
  assert mem["argument"] == pytest.approx(_hand_argument_bytes(cfg), rel=0.01)
  assert mem["needed"] < HBM_BYTES[hardware]
