"""Entry points: export --random -> run (streams text), clear error on a corrupt file; llama.cpp peer."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1")


def _run(args, timeout=240):
  return subprocess.run([sys.executable, "-m"] + args, cwd=ROOT, env=ENV, capture_output=True, text=True,
                        timeout=timeout)


@pytest.mark.entry
@pytest.mark.slow  # framework init + JAX start-up: ~1.5 min on the loaded 2-core machine
def test_export_random_cli(tmp_path):
  out = str(tmp_path / "m.gguf")
  r = _run(["ondevice.export", "--random", "--config", "experiments/configs/ondevice_tiny.py", "--out", out,
            "--quant", "q4_0", "--config.model.n_layers=2"])
  assert r.returncode == 0, r.stderr
  assert json.loads(r.stdout.strip().splitlines()[-1])["quant"] == "q4_0"


@pytest.mark.entry
def test_run_cli_streams_text_and_rejects_truncated_file(files, tmp_path):
  out = str(tmp_path / "m.gguf")
  with open(files["q4_0"], "rb") as f:
    data = f.read()
  with open(out, "wb") as f:
    f.write(data)
  r = _run(["ondevice.run", "--model", out, "--prompt", "def f", "--max-tokens", "6", "--greedy", "--no-stop"])
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("def f")
  summary = json.loads(r.stderr.strip().splitlines()[-1])
  assert summary["tokens"] == 6 and summary["clock"] == "wall"
  with open(out, "r+b") as f:
    f.truncate(len(data) // 2)
  r = _run(["ondevice.run", "--model", out, "--prompt", "x", "--max-tokens", "2"])
  assert r.returncode == 2 and "truncated" in r.stderr and "re-export" in r.stderr


def test_llama_cpp_greedy_tokens_match(files):
  """Optional peer: same GGUF in llama.cpp (llama-cpp-python) gives the same greedy tokens."""
  llama_cpp = pytest.importorskip(
      "llama_cpp", reason="llama-cpp-python not installed (its source build did not finish in 10 min here)")
  from ondevice import forward
  from ondevice.weights import MappedGGUF
  from .conftest import PROMPT
  for q in ("f32", "q8_0", "q4_0"):
    m = forward.GGUFLlama(MappedGGUF(files[q]))
    ours = forward.greedy_generate(m, PROMPT, 8)
    llm = llama_cpp.Llama(files[q], n_ctx=64, n_threads=1, logits_all=True, type_k=0, type_v=0, verbose=False)
    assert llm.tokenize(bytes(PROMPT), add_bos=False, special=False) == PROMPT
    llm.eval(PROMPT)
    theirs = []
    for _ in range(8):
      tok = int(llm.scores[llm.n_tokens - 1].argmax())
      theirs.append(tok)
      llm.eval([tok])
    assert ours == theirs, q
