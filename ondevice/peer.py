"""The llama.cpp peer (llama-cpp-python): how it was built, and whether it decodes on this machine.

``ondevice.bench`` and the parity tests compare our engine with llama.cpp. A llama.cpp build can import and
load a model and still crash at its first decode: one compiled with ``-march=native`` on a machine whose cpuid
lists AMX tiles that the machine cannot run does exactly that. So the peer is trusted only after a *child
process* has loaded a tiny GGUF and decoded a few tokens with it; a crash there ends the child, never the
caller, and comes back as one line.

    python -m ondevice.peer smoke [--site DIR]   # "ok: ..." (exit 0) or "error: ..." (exit 1)
    python -m ondevice.peer verify-wheel WHEEL   # installs WHEEL into a temporary folder, smoke-decodes it there

``.ci/llama_cpp_wheel.sh`` runs ``verify-wheel`` before it caches a wheel and ``smoke`` after installing one.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import zipfile

SMOKE_TOKENS = 4
_PROMPT = list(b"def main():\n    ")
REBUILD = "rebuild it for what this CPU runs with .ci/llama_cpp_wheel.sh"

# The child: import llama_cpp from the given place, print how it was built, then load the GGUF and decode
# the prompt and SMOKE_TOKENS greedy tokens through the C API. Nothing but llama_cpp and numpy is imported.
_CHILD = r"""
import ctypes, json, sys
site, path, prompt, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
if site:
  sys.path.insert(0, site)
import numpy as np
import llama_cpp as L
print(json.dumps({"stage": "imported", "file": L.__file__, "version": L.__version__,
                  "system_info": L.llama_print_system_info().decode().strip()}), flush=True)
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
if not model:
  sys.exit("llama_model_load_from_file returned NULL")
p = L.llama_context_default_params()
p.n_ctx = p.n_batch = p.n_ubatch = 64
p.n_threads = p.n_threads_batch = 1
ctx = L.llama_init_from_model(model, p)
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
print(json.dumps({"stage": "loaded"}), flush=True)
toks, out = list(prompt), []
for i in range(n + 1):
  feed = toks if i == 0 else out[-1:]
  arr = (ctypes.c_int32 * len(feed))(*feed)
  rc = L.llama_decode(ctx, L.llama_batch_get_one(arr, len(feed)))
  if rc != 0:
    sys.exit(f"llama_decode returned {rc}")
  logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(vocab,))
  if not np.isfinite(logits).all():
    sys.exit("llama_decode gave non-finite logits")
  if i < n:
    out.append(int(np.argmax(logits)))
L.llama_free(ctx)
L.llama_model_free(model)
print(json.dumps({"stage": "decoded", "tokens": out}), flush=True)
"""


class PeerCrash(RuntimeError):
  """The installed llama.cpp peer failed its smoke decode; the message is ``Smoke.line``."""


@dataclasses.dataclass(frozen=True)
class Smoke:
  ok: bool
  line: str  # one line: what ran, or why the peer cannot be used
  system_info: str = ""
  version: str = ""
  tokens: tuple = ()


def _tiny_gguf(path: str) -> None:
  from ondevice.gguf_io import random_arrays, tiny_config, write_arrays
  cfg = tiny_config(n_layers=2, max_seq_len=64)
  write_arrays(random_arrays(cfg, seed=3), cfg, path, "q4_0")


def _signal_name(rc: int) -> str:
  try:
    return signal.Signals(-rc).name
  except ValueError:
    return f"signal {-rc}"


def smoke(site: str | None = None, timeout: float = 180.0, python: str | None = None) -> Smoke:
  """Loads a tiny Q4_0 GGUF in a child process with the llama_cpp found first on ``site`` (else the installed
  one) and decodes ``SMOKE_TOKENS`` tokens. Never raises for a broken peer: the result says what happened."""
  with tempfile.TemporaryDirectory(prefix="prismllm-peer-") as d:
    path = os.path.join(d, "tiny-q4_0.gguf")
    _tiny_gguf(path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
      r = subprocess.run([python or sys.executable, "-c", _CHILD, site or "", path, json.dumps(_PROMPT),
                          str(SMOKE_TOKENS)], capture_output=True, text=True, timeout=timeout, env=env, cwd=d)
    except subprocess.TimeoutExpired:
      return Smoke(False, f"the llama.cpp peer did not finish decoding a tiny model in {timeout:.0f} s; {REBUILD}")
  stages = {}
  for ln in r.stdout.splitlines():
    try:
      msg = json.loads(ln)
    except ValueError:
      continue
    if isinstance(msg, dict) and "stage" in msg:
      stages[msg["stage"]] = msg
  info = stages.get("imported", {})
  sysinfo, version = info.get("system_info", ""), info.get("version", "")
  built = f" (llama-cpp-python {version}, {sysinfo})" if info else ""
  if r.returncode < 0:
    where = "at its first decode" if "loaded" in stages else "loading a tiny model" if info else "on import"
    return Smoke(False, f"the llama.cpp peer crashed ({_signal_name(r.returncode)}) {where}{built}: its build "
                        f"uses instructions this machine cannot run; {REBUILD}", sysinfo, version)
  if r.returncode != 0 or "decoded" not in stages:
    tail = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
    return Smoke(False, f"the llama.cpp peer failed{built}: {tail}", sysinfo, version)
  toks = tuple(stages["decoded"]["tokens"])
  return Smoke(True, f"llama-cpp-python {version} decoded {len(toks)} tokens of a tiny model: {sysinfo}",
               sysinfo, version, toks)


@functools.lru_cache(maxsize=1)
def checked() -> Smoke:
  """``smoke()`` of the installed peer, once per process (the parity tests and the bench ask before use)."""
  return smoke()


def verify_wheel(wheel: str, timeout: float = 180.0) -> Smoke:
  """Unpacks ``wheel`` into a temporary folder (nothing is installed) and smoke-decodes it from there."""
  if not zipfile.is_zipfile(wheel):
    return Smoke(False, f"{wheel} is not a wheel (zip) file; {REBUILD}")
  with tempfile.TemporaryDirectory(prefix="prismllm-wheel-") as site:
    with zipfile.ZipFile(wheel) as z:
      z.extractall(site)
    return smoke(site, timeout)


def system_info() -> dict:
  """How the installed peer was built, for benchmark records: version and llama.cpp's system info line."""
  import llama_cpp
  return {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m ondevice.peer", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = ap.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("smoke", help="decode a tiny model with the installed llama_cpp (or the one under --site)")
  s.add_argument("--site", default=None, help="a folder holding the llama_cpp package to check")
  v = sub.add_parser("verify-wheel", help="decode a tiny model with the llama_cpp inside WHEEL")
  v.add_argument("wheel")
  for p in (s, v):
    p.add_argument("--timeout", type=float, default=180.0)
  args = ap.parse_args(argv)
  res = smoke(args.site, args.timeout) if args.cmd == "smoke" else verify_wheel(args.wheel, args.timeout)
  print(("ok: " if res.ok else "error: ") + res.line, file=sys.stdout if res.ok else sys.stderr)
  return 0 if res.ok else 1


if __name__ == "__main__":
  sys.exit(main())
