"""Positions past the model's trained context (the GGUF's context_length) need --allow-long-context
(ondevice/errors.py, ondevice/run.py): refused in one line otherwise, warned about when allowed."""
from benchmarks.reliability.ondevice_area import classify, invoke

from .conftest import TINY  # trained context: TINY.max_seq_len = 64 tokens


def test_generation_past_the_trained_context_needs_the_flag(files):
  model = files["q8_0"]
  # 9 prompt bytes + 100 tokens = 109 > 64; --ctx 200 holds them, so only the trained context is in the way
  argv = ["--model", model, "--prompt", "def f(x):", "--max-tokens", "100", "--ctx", "200", "--no-stop"]
  r = invoke("ondevice.run", argv)
  o, err = classify(r), r.err
  assert o.kind == "clear_error", o
  assert f"past the model's trained context of {TINY.max_seq_len} tokens" in err
  assert "RoPE scaling is not implemented" in err and "--allow-long-context" in err
  assert f"lower --max-tokens to {TINY.max_seq_len - 9}" in err

  r = invoke("ondevice.run", argv + ["--allow-long-context"])
  rc, out, err, exc = r.rc, r.out, r.err, r.exc
  assert exc is None and rc == 0, err
  assert "warning: generating up to position 109, past the model's trained context of 64 tokens" in err
  assert len(out.strip()) > len("def f(x):")

  r = invoke("ondevice.run", ["--model", model, "--prompt", "def f(x):", "--max-tokens", "40", "--ctx", "200",
                               "--no-stop"])
  rc, out, err, exc = r.rc, r.out, r.err, r.exc
  assert exc is None and rc == 0 and "warning" not in err  # within the trained context: nothing to say
