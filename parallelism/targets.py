"""Compile for the target: devices of a TPU pod or GPU cluster that exist only for XLA's compiler.

A program compiled on them is the program the real machine would run (TPU or GPU HLO after every
backend pass, its schedule, its per-chip memory), compiled on this host without the hardware.

API
  HARDWARE                                        the names below
  plan(hardware, n_devices, topology=None)        -> Target: slice shape, slices, hosts (no compiler needed)
  compile_only_devices(hardware, n_devices, topology=None) -> list of jax devices (cached per target)
  target_mesh(cfg_mesh, hardware, topology=None)  -> jax.sharding.Mesh shaped like a framework MeshConfig
  compiled_memory(compiled)                       -> per-chip bytes of a compiled executable (see there)

  mesh = target_mesh(cfg.mesh, "tpu_v5p")         # 8 v5p chips if cfg.mesh has 8 devices
  compiled = parallelism.step.build_step(cfg, mesh).lower().compile()
  compiled.as_text(); compiled_memory(compiled)

Hardware
  tpu_v4, tpu_v5p  3D torus slices: 2x2x1, 2x2x2, 2x2x4, 2x4x4 (4-32 chips), then whole 4x4x4 cubes
                   (64 chips each, up to 64 cubes on v4, 96 on v5p); one device per chip (megacore).
  tpu_v5e, tpu_v6e 2D slices 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16 (up to 256 chips).
                   A count above one slice's maximum becomes k equal slices joined over the data-center
                   network (multi-slice), the fewest k that works.
  a100, h100, h200 8 GPUs per node (HGX), one NVLink domain per node: n <= 8 is part of one node, above
                   that whole nodes ('<nodes>x1x8'). Descriptions in parallelism/gpu_specs/.
  ``topology`` overrides the shape: '4x4x8' (TPU slice; the count may be a multiple of it: slices) or
  'PxHxD' for GPUs (NVLink domains x hosts per domain x GPUs per host).

Set-up: ``pip install -e ".[tpu-aot]"`` (libtpu and the CUDA plugin; no GPU, TPU or CUDA libraries needed).
Run with ``JAX_PLATFORMS=cpu`` when no accelerator is attached: the CUDA plugin then registers without
looking for CUDA libraries (otherwise it fails its start-up check and offers no GPU compiler), and jax's
own devices stay CPU. Loading libtpu for compiling sets ALLOW_MULTIPLE_LIBTPU_LOAD=1 unless set: libtpu
otherwise holds /tmp/libtpu_lockfile and a second process (a pytest-xdist worker, a colleague's run)
fails with "Internal error when accessing libtpu multi-process lockfile".
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import os
import pathlib
import re
from typing import Optional

from jax._src import xla_bridge
from jax._src.cudnn import fused_attention_stablehlo as fa
from jax._src.lib import xla_client
from jax.experimental import mesh_utils, topologies
from jax.sharding import AxisType, Mesh

from framework.config import MESH_AXES, ConfigError, MeshConfig, resolve_mesh
from parallelism import mesh as mesh_lib

SPECS = pathlib.Path(__file__).with_name("gpu_specs")
INSTALL = 'pip install -e ".[tpu-aot]"'


class TargetError(ConfigError):
  """A target that cannot be compiled for; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class _Tpu:
  prefix: str  # libtpu's topology-name prefix
  rank: int  # 3: torus of 4x4x4 cubes; 2: one 2D slice
  max_chips: int  # largest single slice
  chip_config: str  # 'megacore': one jax device per chip (v4/v5p chips have two TensorCores)


# Slice limits: Cloud TPU documentation ("TPU v4", "TPU v5p", "TPU v5e", "TPU v6e" pages): a v4 pod is
# 4096 chips (64 cubes); the largest v5p slice is 16x16x24 (6144 chips, 96 cubes); v5e/v6e slices end at
# 16x16. libtpu accepts shapes beyond these (e.g. v5p 16x24x24), so they are checked here.
_TPUS = {
    "tpu_v4": _Tpu("v4", 3, 4096, "megacore"),
    "tpu_v5p": _Tpu("v5p", 3, 6144, "megacore"),
    "tpu_v5e": _Tpu("v5e", 2, 256, "default"),
    "tpu_v6e": _Tpu("v6e", 2, 256, "default"),
}
_GPUS = {"a100": "a100.txtpb", "h100": "h100.txtpb", "h200": "h200.txtpb"}
GPUS_PER_NODE = 8
HARDWARE = tuple(_TPUS) + tuple(_GPUS)

_SMALL_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}  # below one cube
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


@dataclasses.dataclass(frozen=True)
class Target:
  hardware: str
  n_devices: int
  topology: str  # TPU: one slice's shape ('2x2x2'); GPU: 'PxHxD'
  num_slices: int = 1  # TPU slices joined over the data-center network
  chips_per_host: tuple = ()  # TPU host bounds

  @property
  def is_tpu(self) -> bool:
    return self.hardware in _TPUS


def _fmt(shape) -> str:
  return "x".join(str(s) for s in shape)


def _check_hardware(hardware: str) -> str:
  h = str(hardware).lower().replace("-", "_")
  if h not in HARDWARE:
    raise TargetError(f"unknown hardware {hardware!r}; choose one of {', '.join(HARDWARE)}")
  return h


def _cube_shape(cubes: int) -> tuple:
  """The most cube-like a<=b<=c with a*b*c = cubes, in chips (x4): Cloud TPU's default shape per count."""
  best = None
  for a in range(1, cubes + 1):
    for b in range(a, cubes // a + 1):
      if cubes % (a * b) == 0 and cubes // (a * b) >= b:
        c = cubes // (a * b)
        key = (c / a, c)
        if best is None or key < best[0]:
          best = (key, (4 * a, 4 * b, 4 * c))
  return best[1]


def _slice_shape(gen: _Tpu, chips: int) -> Optional[tuple]:
  """The default slice shape of ``chips`` chips, or None when no slice of that size exists."""
  if chips > gen.max_chips:
    return None
  if gen.rank == 2:
    return _SHAPES_2D.get(chips)
  if chips in _SMALL_3D:
    return _SMALL_3D[chips]
  return _cube_shape(chips // 64) if chips % 64 == 0 else None


def _valid_counts_text(hardware: str) -> str:
  if hardware in _GPUS:
    return f"1, 2, 4 or 8 (part of one node) or a multiple of {GPUS_PER_NODE} (whole nodes)"
  gen = _TPUS[hardware]
  if gen.rank == 2:
    one = ", ".join(str(n) for n in _SHAPES_2D)
  else:
    one = f"{', '.join(str(n) for n in _SMALL_3D)} or a multiple of 64 up to {gen.max_chips}"
  return f"{one} chips in one slice, or k equal slices of those"


def _host_bounds(gen: _Tpu, shape: tuple) -> tuple:
  # 4-chip hosts (2x2x1) everywhere except a lone v5e/v6e chip and the 8-chip single-host 2x4 machines.
  if gen.rank == 2 and shape == (1, 1):
    return (1, 1, 1)
  if gen.rank == 2 and shape == (2, 4):
    return (2, 4, 1)
  return (2, 2, 1)


def _parse_shape(topology: str, hardware: str, rank: int) -> tuple:
  prefix, _, text = topology.strip().lower().rpartition(":")
  if prefix and (hardware not in _TPUS or prefix not in (_TPUS[hardware].prefix, _TPUS[hardware].prefix[:2])):
    raise TargetError(f"topology {topology!r} names another system than {hardware}; give the shape alone")
  if not re.fullmatch(r"\d+(x\d+)*", text) or len(text.split("x")) != rank:
    want = ("PxHxD like 2x1x8" if hardware in _GPUS else "AxBxC like 4x4x8" if rank == 3 else "AxB like 4x8")
    raise TargetError(f"topology {topology!r} for {hardware} must look like {want}")
  return tuple(int(s) for s in text.split("x"))


def _valid_3d(gen: _Tpu, shape: tuple) -> bool:
  s = tuple(sorted(shape))
  if s in {tuple(sorted(v)) for v in _SMALL_3D.values()}:
    return True
  return all(d % 4 == 0 and d > 0 for d in s) and math.prod(s) <= gen.max_chips


def plan(hardware: str, n_devices: int, topology: Optional[str] = None) -> Target:
  """Where ``n_devices`` of ``hardware`` sit: slice shape and slices (TPU) or nodes (GPU). Pure: no compiler."""
  hardware = _check_hardware(hardware)
  n = int(n_devices)
  if n < 1:
    raise TargetError(f"device count must be >= 1, got {n_devices}")
  if hardware in _GPUS:
    return _plan_gpu(hardware, n, topology)
  gen = _TPUS[hardware]
  if topology is not None:
    shape = _parse_shape(topology, hardware, gen.rank)
    ok = _valid_3d(gen, shape) if gen.rank == 3 else tuple(sorted(shape)) in {
        tuple(sorted(v)) for v in _SHAPES_2D.values()}
    if not ok:
      raise TargetError(f"{hardware} has no {_fmt(shape)} slice; slices hold {_valid_counts_text(hardware)}")
    per = math.prod(shape)
    if n % per:
      raise TargetError(f"{n} {hardware} chips are not a whole number of {_fmt(shape)} slices ({per} chips "
                        f"each); use a multiple of {per} or another topology")
    return Target(hardware, n, _fmt(shape), n // per, _host_bounds(gen, shape))
  # One slice while it fits; above that the fewest equal slices (so the largest ones) that exist.
  first = 1 if n <= gen.max_chips else -(-n // gen.max_chips)
  for slices in range(first, n + 1):
    if n % slices == 0 and (shape := _slice_shape(gen, n // slices)) is not None:
      return Target(hardware, n, _fmt(shape), slices, _host_bounds(gen, shape))
    if n <= gen.max_chips:
      break
  raise TargetError(f"no {hardware} system has {n} chips; valid counts: {_valid_counts_text(hardware)}")


def _plan_gpu(hardware: str, n: int, topology: Optional[str]) -> Target:
  if topology is not None:
    dims = _parse_shape(topology, hardware, 3)
    if math.prod(dims) != n or min(dims) < 1:
      raise TargetError(f"GPU topology {topology!r} holds {math.prod(dims)} devices, not {n}; "
                        f"give PxHxD with P*H*D = {n}")
    return Target(hardware, n, _fmt(dims))
  if n <= GPUS_PER_NODE and n in (1, 2, 4, 8):
    return Target(hardware, n, f"1x1x{n}")
  if n % GPUS_PER_NODE == 0:
    return Target(hardware, n, f"{n // GPUS_PER_NODE}x1x{GPUS_PER_NODE}")
  raise TargetError(f"{n} {hardware} GPUs do not fill whole {GPUS_PER_NODE}-GPU nodes; valid counts: "
                    f"{_valid_counts_text(hardware)} (or give topology='PxHxD')")


def gpu_target_config(hardware: str) -> str:
  """The GpuTargetConfigProto text XLA compiles against: the spec file plus the versions of the installed CUDA
  plugin's libraries, which a real machine running that plugin reports too. cuDNN: XLA enables its cuDNN-backed
  rewrites only for a cuDNN it is told about. CUDA runtime: XLA rewrites fp8 dots into cuBLASLt fp8 GEMMs
  (``__cublas$lt$matmul$f8``) only for a runtime of at least 12.0; without one it widens the fp8 operands and
  runs a bf16 GEMM."""
  hardware = _check_hardware(hardware)
  if hardware not in _GPUS:
    raise TargetError(f"{hardware} is a TPU; GPU target configs exist for {', '.join(_GPUS)}")
  text = (SPECS / _GPUS[hardware]).read_text()
  try:
    from jax_cuda12_plugin import _versions  # noqa: PLC0415 (optional dependency: the tpu-aot extra)
    cuda = int(_versions.cuda_runtime_build_version())  # e.g. 12090 = 12.9
    runtime = f'"{cuda // 1000}.{cuda // 10 % 100}.0"'
    info = f"  runtime_version: {runtime}\n  compile_time_toolkit_version: {runtime}\n"
    head, sep, tail = text.rpartition("\n}\nplatform_name")  # the end of the gpu_device_info block
    text = head + "\n" + info.rstrip("\n") + sep + tail if sep else text
    v = int(_versions.cudnn_build_version())  # e.g. 90800 = 9.8.0
    text += f"dnn_version_info {{ major: {v // 10000} minor: {v // 100 % 100} patch: {v % 100} }}\n"
  except (ImportError, AttributeError, RuntimeError):
    pass  # no versions known: XLA compiles without cuDNN rewrites and without fp8 GEMMs
  return text


def _compute_capability(hardware: str) -> tuple:
  m = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)", (SPECS / _GPUS[hardware]).read_text())
  return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@contextlib.contextmanager
def trace_context(hardware: str):
  """Tracing for a compile-only GPU: jax's cuDNN attention asks the *runtime* cuDNN library for its version and
  the local GPU for its compute capability, neither of which exists here; inside this context they are answered
  from the CUDA plugin's cuDNN build version and the target's description (the values the compiler is given,
  :func:`gpu_target_config`). TPU targets and a host with a GPU need nothing."""
  hardware = _check_hardware(hardware)
  if hardware not in _GPUS or not _importable("jax_plugins.xla_cuda12"):
    yield
    return
  try:
    from jax_cuda12_plugin import _versions  # noqa: PLC0415 (optional dependency: the tpu-aot extra)
    version = int(_versions.cudnn_build_version())
  except (ImportError, AttributeError, RuntimeError):
    yield
    return
  cc = _compute_capability(hardware)
  parse = lambda c: tuple(int(x) for x in c.split("."))  # noqa: E731
  saved = (fa.check_cudnn_version, fa.check_compute_capability, fa.is_cuda_compute_capability_equal)
  fa.check_cudnn_version = lambda: version
  fa.check_compute_capability = lambda c: cc >= parse(c)
  fa.is_cuda_compute_capability_equal = lambda c: cc == parse(c)
  try:
    yield
  finally:
    fa.check_cudnn_version, fa.check_compute_capability, fa.is_cuda_compute_capability_equal = saved


@functools.lru_cache(maxsize=None)
def _devices(target: Target) -> tuple:
  # Cached: jax keys compiled programs and shardings on device identity, and a second topology object
  # would give different (incompatible) devices for the same target.
  if target.is_tpu:
    return tuple(_tpu_devices(target))
  return tuple(_gpu_devices(target))


def compile_only_devices(hardware: str, n_devices: int, topology: Optional[str] = None) -> list:
  """``n_devices`` compile-only devices of ``hardware`` (see the module docstring for shapes)."""
  return list(_devices(plan(hardware, n_devices, topology)))


def _importable(module: str) -> bool:
  """Whether an optional package (the tpu-aot extra) is installed."""
  try:
    importlib.import_module(module)
  except ImportError:
    return False
  return True


def _tpu_devices(target: Target) -> list:
  if not _importable("libtpu"):
    raise TargetError(f"compiling for {target.hardware} needs libtpu: {INSTALL}")
  if not xla_client.pjrt_plugin_loaded("tpu"):  # this process drives no TPU: load libtpu as a compiler only
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  gen = _TPUS[target.hardware]
  desc = topologies.get_topology_desc(
      platform="tpu", topology_name=f"{gen.prefix}:{target.topology}", chip_config_name=gen.chip_config,
      chips_per_host_bounds=target.chips_per_host, num_slices=target.num_slices)
  devices = list(desc.devices)
  if len(devices) != target.n_devices:  # e.g. a chip config that exposes each TensorCore as a device
    raise TargetError(f"libtpu made {len(devices)} devices for {target}, expected {target.n_devices}")
  return devices


def _gpu_devices(target: Target) -> list:
  if not _importable("jax_plugins.xla_cuda12"):
    raise TargetError(f"compiling for {target.hardware} needs the CUDA plugin: {INSTALL}")
  try:
    topo = xla_bridge.make_pjrt_topology("cuda", target.topology, topology=target.topology,
                                         target_config=gpu_target_config(target.hardware))
  except NotImplementedError:  # the plugin is installed but did not register
    raise TargetError("the CUDA plugin did not start (no CUDA libraries here); run with JAX_PLATFORMS=cpu "
                      "so it registers as a compiler only") from None
  devices = list(topo._make_compile_only_devices())  # noqa: SLF001 - jax's only way to these devices
  if len(devices) != target.n_devices:
    raise TargetError(f"the CUDA plugin made {len(devices)} devices for {target}, expected {target.n_devices}")
  return devices


def target_mesh(cfg_mesh: MeshConfig, hardware: str, topology: Optional[str] = None) -> Mesh:
  """A Mesh over compile-only devices of ``hardware`` with ``cfg_mesh``'s axes. The device count is the
  product of the axes; an axis of -1 takes the rest of ``topology`` (one TPU slice or the GPU shape)."""
  sizes = cfg_mesh.sizes()
  if -1 in sizes.values():
    if topology is None:
      raise TargetError(f"mesh {sizes} has a -1 axis: set every axis or give a topology to fill")
    n = math.prod(int(s) for s in topology.split(":", 1)[-1].lower().split("x") if s.isdigit())
  else:
    n = math.prod(sizes.values())
  target = plan(hardware, n, topology)
  devices = _devices(target)
  cfg_mesh = resolve_mesh(cfg_mesh, len(devices))
  if target.num_slices == 1:
    return mesh_lib.make_mesh(cfg_mesh, devices)
  return _multislice_mesh(cfg_mesh, devices, target.num_slices)


def _multislice_mesh(cfg_mesh: MeshConfig, devices, num_slices: int) -> Mesh:
  """Slices span the outermost axes (pipeline, then data, ...): only their collectives cross the slow
  data-center network, and inside a slice the devices keep jax's physical (ICI ring) order."""
  shape = [getattr(cfg_mesh, a) for a in MESH_AXES]
  dcn, left = [1] * len(shape), num_slices
  for i, s in enumerate(shape):
    g = math.gcd(s, left)
    dcn[i], left = g, left // g
    if left == 1:
      break
  if left != 1:
    raise TargetError(f"{num_slices} slices cannot split the outer mesh axes {cfg_mesh.sizes()}: make "
                      f"pipeline x data (the outermost axes) a multiple of {num_slices}")
  ici = [s // d for s, d in zip(shape, dcn)]
  try:
    arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, list(devices))
  except (NotImplementedError, ValueError):  # e.g. an axis of 8 on a 16x16x16 slice: split a physical axis
    arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, list(devices), allow_split_physical_axes=True)
  # Auto axes, like parallelism/mesh.py: Explicit axes reject the sharded gathers the step uses.
  return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def wraparound(hardware: str, shape: tuple) -> tuple:
  """Which axes of a TPU slice close into rings. v4 / v5p: axes of whole 4x4x4 cubes (a multiple of 4) wrap;
  v5e / v6e: only the full 16 of a 16x16 slice (Cloud TPU system-architecture pages; jax-ml/scaling-book
  @0819a7d tpus.md: 'wraparounds only for the full pod/cube')."""
  gen = _TPUS[_check_hardware(hardware)]
  return tuple((s % 4 == 0) if gen.rank == 3 else (s == 16) for s in shape)


def compiled_memory(compiled) -> dict:
  """Per-chip device-memory bytes of a compiled executable (``jax.stages.Compiled``).

  argument, output: the program's inputs and outputs on one chip (TPU: with tile padding, e.g. a
    (2, 1024) f32 array occupies an (8, 1024) tile; GPU: exact element bytes).
  alias: output bytes written into donated inputs (counted once in ``peak``).
  temp: XLA's temporary allocation. GPU: one heap that holds every intermediate. TPU: may exceed what is
    ever live in HBM at once (observed 4x over the live peak on a small step), so it is no memory bound.
  generated_code: the program binary (TPU: loaded into HBM; GPU reports 0).
  peak: the compiler's own peak of simultaneously live buffers, arguments and outputs included
    (``peak_memory_in_bytes``; GPU: the heap simulation of XLA's buffer assignment, equal to
    argument + output - alias + temp up to padding); when a backend reports none, that sum.
  needed: peak + generated_code: the HBM one chip needs to run the program.
  host_temp / host_argument / host_output: bytes offloaded to host memory (pinned host memory space).
  """
  m = compiled.memory_analysis()
  if m is None:
    raise TargetError("this executable reports no memory analysis (the CPU backend of some jax versions)")
  out = {
      "argument": int(m.argument_size_in_bytes),
      "output": int(m.output_size_in_bytes),
      "alias": int(m.alias_size_in_bytes),
      "temp": int(m.temp_size_in_bytes),
      "generated_code": int(m.generated_code_size_in_bytes),
      "host_argument": int(m.host_argument_size_in_bytes),
      "host_output": int(m.host_output_size_in_bytes),
      "host_temp": int(m.host_temp_size_in_bytes),
  }
  total = out["argument"] + out["output"] - out["alias"] + out["temp"]
  reported = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
  out["peak"] = reported if reported > 0 else total
  out["peak_source"] = "xla" if reported > 0 else "sum"
  out["needed"] = out["peak"] + out["generated_code"]
  return out
