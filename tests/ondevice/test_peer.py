"""The llama.cpp peer is trusted only after a child process decoded a tiny model with it (ondevice/peer.py), and
.ci/llama_cpp_wheel.sh never caches or installs a wheel that fails that decode.

Stub wheels stand in for broken builds: a ``llama_cpp`` package with the C-API names the smoke decode calls,
which crashes (a real SIGSEGV: a NULL read through ctypes), hangs, or works, at a chosen stage.
"""
import os
import subprocess
import sys
import zipfile

import pytest

from ondevice import peer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_STUB = '''
import ctypes, time
__version__ = "0.3.36"
MODE = {mode!r}
def _maybe(stage):
  if MODE == "crash_" + stage:
    ctypes.string_at(0)  # SIGSEGV, as a build with instructions the CPU cannot run does
  if MODE == "hang_" + stage:
    time.sleep(3600)
_maybe("import")
class _P:
  n_ctx = n_batch = n_ubatch = n_threads = n_threads_batch = 0
_logits = (ctypes.c_float * 256)(*[float(i % 7) for i in range(256)])
def llama_print_system_info(): return b"CPU : STUB = 1 |"
def llama_backend_init(): pass
def llama_model_default_params(): return _P()
def llama_context_default_params(): return _P()
def llama_model_load_from_file(path, params):
  _maybe("load")
  return 1
def llama_init_from_model(model, params): return 1
def llama_model_get_vocab(model): return 1
def llama_vocab_n_tokens(vocab): return 256
def llama_batch_get_one(arr, n): return (arr, n)
def llama_decode(ctx, batch):
  _maybe("decode")
  return 0
def llama_get_logits_ith(ctx, i): return ctypes.cast(_logits, ctypes.POINTER(ctypes.c_float))
def llama_free(ctx): pass
def llama_model_free(model): pass
'''


def _stub_wheel(d, mode: str) -> str:
  """A wheel file of the name the script caches, holding the stub package (no dependencies)."""
  path = os.path.join(str(d), "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl")
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("llama_cpp/__init__.py", _STUB.format(mode=mode))
    z.writestr("llama_cpp_python-0.3.36.dist-info/METADATA",
               "Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.3.36\n")
  return path


@pytest.mark.parametrize("stage,where", [("decode", "at its first decode"), ("load", "loading a tiny model"),
                                         ("import", "on import")])
def test_smoke_refuses_a_wheel_that_crashes(tmp_path, stage, where):
  res = peer.verify_wheel(_stub_wheel(tmp_path, f"crash_{stage}"))
  assert not res.ok
  assert res.line.startswith(f"the llama.cpp peer crashed (SIGSEGV) {where}"), res.line
  assert "\n" not in res.line and ".ci/llama_cpp_wheel.sh" in res.line
  if stage != "import":
    assert "STUB = 1" in res.line  # the build's system info is named, so the reader sees what was built


def test_smoke_refuses_a_wheel_that_hangs(tmp_path):
  res = peer.verify_wheel(_stub_wheel(tmp_path, "hang_decode"), timeout=8)
  assert not res.ok and "did not finish decoding" in res.line


def test_smoke_passes_a_wheel_that_decodes(tmp_path):
  """The control: the same stub without a fault passes, so the refusals above come from the faults."""
  res = peer.verify_wheel(_stub_wheel(tmp_path, "none"))
  assert res.ok, res.line
  assert len(res.tokens) == peer.SMOKE_TOKENS and res.system_info == "CPU : STUB = 1 |"


def test_smoke_refuses_a_file_that_is_not_a_wheel(tmp_path):
  p = tmp_path / "x.whl"
  p.write_text("not a zip")
  res = peer.verify_wheel(str(p))
  assert not res.ok and "not a wheel" in res.line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the wheel script is for Linux hosts")
def test_wheel_script_removes_a_cached_wheel_that_crashes(tmp_path):
  """.ci/llama_cpp_wheel.sh with a crashing wheel in its cache slot (PRISM_LLAMA_NO_BUILD=1: no 7-minute build):
  the wheel fails its smoke decode, is removed from the cache, nothing is installed, and the script ends
  with one error line."""
  script = os.path.join(ROOT, ".ci", "llama_cpp_wheel.sh")
  env = dict(os.environ, PRISM_WHEEL_CACHE=str(tmp_path / "cache"), PRISM_LLAMA_NO_BUILD="1", PYTHONPATH=ROOT,
             PYTHON=sys.executable)
  r = subprocess.run(["bash", script, "--print-flags"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 0, r.stderr
  flags, cache = r.stdout.strip().splitlines()
  if os.uname().machine == "x86_64":
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=" in flags and "-DGGML_AMX_INT8=" in flags
  slot = cache.split("cache: ", 1)[1]
  os.makedirs(slot)
  whl = _stub_wheel(slot, "crash_decode")
  before = subprocess.run([sys.executable, "-m", "pip", "show", "-f", "llama_cpp_python"], capture_output=True,
                          text=True).stdout
  r = subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, (r.stdout, r.stderr)
  assert "the llama.cpp peer crashed (SIGSEGV) at its first decode" in r.stderr
  assert r.stderr.strip().splitlines()[-1].startswith("error: no working llama-cpp-python")
  assert not os.path.exists(whl)
  after = subprocess.run([sys.executable, "-m", "pip", "show", "-f", "llama_cpp_python"], capture_output=True,
                         text=True).stdout
  assert after == before  # the stub was never installed


def test_parity_test_reports_a_crashing_peer_as_one_failure(tmp_path):
  """A parity test run where the installed llama_cpp crashes at its first decode (the stub first on the path):
  the test fails with the peer's one line, and the pytest worker survives to report it."""
  site = tmp_path / "site"
  with zipfile.ZipFile(_stub_wheel(tmp_path, "crash_decode")) as z:
    z.extractall(site)
  env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                      "tests/ondevice/test_cli.py::test_llama_cpp_logits_match"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 1, r.stdout[-2000:]
  assert "1 failed" in r.stdout
  assert "the llama.cpp peer crashed (SIGSEGV) at its first decode" in r.stdout


def _probe_ran(stderr: str) -> set:
  """The extensions the script's own probe saw run (its verdicts go to stderr, '  simd probe: NAME ok')."""
  return {ln.split()[2] for ln in stderr.splitlines() if ln.startswith("  simd probe: ") and ln.endswith(" ok")}


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the SIMD probe is for x86-64")
def test_listed_extensions_that_do_not_run_are_left_out(tmp_path):
  """A machine whose cpuid lists AMX (and everything else) gets only what the probe saw run: an extension is
  built in only if it is listed AND it ran, so listing is never enough."""
  script = os.path.join(ROOT, ".ci", "llama_cpp_wheel.sh")
  everything = ("sse4_2 avx avx2 fma f16c bmi2 avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi "
                "avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16")
  env = dict(os.environ, PRISM_CPU_FLAGS=everything, PYTHON=sys.executable)
  r = subprocess.run(["bash", script, "--print-flags"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  flags = r.stdout.splitlines()[0]
  # flags and verdicts from one probe run (a second run of the probe is a second measurement)
  ran = _probe_ran(r.stderr)
  assert "SSE42" in ran or "AVX" in ran, r.stderr  # an x86-64 host runs at least one of them
  names = ("SSE42 AVX AVX2 FMA F16C BMI2 AVX_VNNI AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 AMX_TILE AMX_INT8 "
           "AMX_BF16").split()
  for name in names:
    assert f"-DGGML_{name}={'ON' if name in ran else 'OFF'}" in flags, (name, ran)
  # and nothing is on that the machine does not list, whatever ran
  r = subprocess.run(["bash", script, "--print-flags"], cwd=ROOT, env=dict(env, PRISM_CPU_FLAGS="sse4_2 avx"),
                     capture_output=True, text=True, timeout=120)
  on = {f.split("=")[0][len("-DGGML_"):] for f in r.stdout.split() if f.startswith("-DGGML_") and f.endswith("=ON")}
  assert on == {"SSE42", "AVX"} & _probe_ran(r.stderr)
