"""The ondevice bad-input cases about running (registered into ``ondevice_area.CASES``).

generation: token budgets, prompts and drafts, checked before the first token; plan: devices files and
plans Halda cannot place, checked before any device starts; ring_peer: a ring device killed or frozen
mid-generation (a real subprocess run, the device killed from outside); export: a failed export must not
destroy the file it would have replaced.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

from benchmarks.reliability import harness
from benchmarks.reliability.ondevice_area import case, classify, invoke, run_cli

RUN = "ondevice.run"
ROOT = harness.ROOT


def _run(ws, *argv, ok=None, timeout_s=120.0):
  return run_cli(RUN, ["--model", ws.good, *argv], ok, timeout_s)


# ------------------------------------------------------------------------------------------ generation

@case("generation")
def _max_tokens_beyond_context(ws):
  return _run(ws, "--prompt", "def f(x):", "--max-tokens", "400", "--ctx", "256")


@case("generation")
def _past_the_trained_context(ws):
  """--ctx large enough, but the positions run past the model's 256-token trained context: needs the flag."""
  o = _run(ws, "--prompt", "def f(x):", "--max-tokens", "300", "--ctx", "400")
  if o.kind == "clear_error" and "--allow-long-context" not in o.detail:
    o.kind = "unclear_error"
  return o


@case("generation")
def _prompt_longer_than_context(ws):
  return _run(ws, "--prompt", "x" * 300, "--max-tokens", "4", "--ctx", "256")


@case("generation")
def _zero_context(ws):
  return _run(ws, "--prompt", "a", "--ctx", "0")


@case("generation")
def _zero_max_tokens(ws):
  return _run(ws, "--prompt", "a", "--max-tokens", "0")


@case("generation")
def _prompt_ids_outside_vocab(ws):
  return _run(ws, "--prompt-ids", "1,2,300")


@case("generation")
def _prompt_ids_not_numbers(ws):
  return _run(ws, "--prompt-ids", "1,two,3")


@case("generation")
def _empty_prompt(ws):
  return _run(ws, "--prompt", "")


@case("generation")
def _draft_is_the_target(ws):
  return _run(ws, "--prompt", "a", "--draft", ws.good)


@case("generation")
def _draft_with_other_vocabulary(ws):
  from ondevice.gguf_io import random_arrays, tiny_config  # noqa: PLC0415
  from ondevice.gguf_io import write_arrays
  cfg = tiny_config(vocab_size=300, n_layers=1)
  p = ws.path("draft-vocab300.gguf")
  if not os.path.exists(p):
    write_arrays(random_arrays(cfg, 3), cfg, p, "q8_0")
  return _run(ws, "--prompt", "a", "--draft", p)


@case("generation")
def _gamma_zero(ws):
  return _run(ws, "--prompt", "a", "--draft", ws.draft, "--gamma", "0")


@case("generation")
def _model_is_a_directory(ws):
  return run_cli(RUN, ["--model", ws.root, "--prompt", "a"])


@case("generation")
def _speculative_until_context_end(ws):
  """Speculative decoding filling the context exactly: must stop at the limit with the greedy text."""
  ref = invoke(RUN, ["--model", ws.good, "--prompt", "def f", "--max-tokens", "59", "--ctx", "64", "--no-stop"]).out
  return _run(ws, "--prompt", "def f", "--max-tokens", "59", "--ctx", "64", "--no-stop", "--draft", ws.draft,
              "--gamma", "5", ok=lambda out, err: out == ref)


# ------------------------------------------------------------------------------------------ plan

_DEV2 = """devices:
  - {name: a, ram_mb: 64, disk_mbps: 100, link_mbps: 100, link_latency_ms: 1}
  - {name: b, ram_mb: 64, disk_mbps: 100, link_mbps: 100, link_latency_ms: 1}
"""


def _ring(ws, dev_text, *argv, name="dev.yaml", model=None, ok=None):
  d = ws.devices(name, dev_text) if dev_text is not None else ws.path(name)
  return run_cli(RUN, ["--model", model or ws.good, "--devices", d, "--prompt", "def f", *argv], ok)


@case("plan")
def _ring_max_tokens_beyond_context(ws):
  return _ring(ws, _DEV2, "--max-tokens", "400", "--ctx", "256")


@case("plan")
def _halda_cannot_place(ws):
  tiny_ram = _DEV2.replace("ram_mb: 64", "ram_mb: 0.05")
  return _ring(ws, tiny_ram, "--max-tokens", "4", "--ctx", "4096", name="dev-small.yaml")


@case("plan")
def _k_does_not_divide_layers(ws):
  return _ring(ws, _DEV2, "--max-tokens", "4", "--k", "3")


@case("plan")
def _windows_do_not_sum(ws):
  return _ring(ws, _DEV2 + "windows: [1, 1]\n", "--max-tokens", "4", name="dev-win.yaml")


@case("plan")
def _devices_file_missing(ws):
  return _ring(ws, None, "--max-tokens", "4", name="nope.yaml")


@case("plan")
def _devices_file_not_yaml(ws):
  return _ring(ws, "devices: [ {name: a, ram_mb: 1\n  - ]]", "--max-tokens", "4", name="dev-bad.yaml")


@case("plan")
def _devices_unknown_key(ws):
  return _ring(ws, _DEV2.replace("disk_mbps", "disk_speed"), "--max-tokens", "4", name="dev-key.yaml")


@case("plan")
def _devices_negative_memory(ws):
  return _ring(ws, _DEV2.replace("ram_mb: 64", "ram_mb: -1", 1), "--max-tokens", "4", name="dev-neg.yaml")


@case("plan")
def _devices_empty_list(ws):
  return _ring(ws, "devices: []\n", "--max-tokens", "4", name="dev-empty.yaml")


# ------------------------------------------------------------------------------------------ ring peers

_DEV3 = """devices:
  - {name: head, ram_mb: 64, disk_mbps: 100, link_mbps: 100, link_latency_ms: 1}
  - {name: mid, ram_mb: 64, disk_mbps: 100, link_mbps: 100, link_latency_ms: 1}
  - {name: tail, ram_mb: 64, disk_mbps: 100, link_mbps: 100, link_latency_ms: 1}
windows: [2, 3, 3]
"""


def _ring_with_fault(ws, action: str, extra: list, timeout_s: float = 120.0, n: int = 200) -> harness.Run:
  """Runs ``ondevice.run`` on a 3-device ring in a subprocess whose device 'tail' (rank 2) SIGKILLs or
  SIGSTOPs itself on its 20th forward pass (ring.py's ONDEVICE_FAULT hook); its session is killed after, so a
  frozen device process cannot outlive the case (rc None: no exit within ``timeout_s``)."""
  d = ws.devices("dev3.yaml", _DEV3)
  argv = ["--model", ws.ring_model, "--devices", d, "--prompt", "def f", "--max-tokens", str(n), "--ctx", "256",
          "--no-stop", *extra]
  env = {"OPENBLAS_NUM_THREADS": "1", "ONDEVICE_FAULT": f"rank=2,after=20,action={action}"}
  r = harness.finish(harness.start(argv, env, module=RUN), timeout_s, gone_s=0.0)
  r.left_pids = []  # the frozen device stands for another machine: its process is the fault, not a leak
  return r


def _reference_text(ws, n=200) -> str:
  return invoke(RUN, ["--model", ws.ring_model, "--prompt", "def f", "--max-tokens", str(n), "--ctx", "256",
                      "--no-stop"]).out


@case("ring_peer", timeout_s=180)
def _peer_killed_replan(ws):
  """A device killed mid-generation: the head drops it, re-plans on the rest and re-prefills; the text is the
  single-device greedy text (nothing lost), and the summary records where it happened."""
  r = _ring_with_fault(ws, "kill", [])
  ref = _reference_text(ws)
  return classify(r, ok=lambda rr: rr.out == ref and json.loads(rr.err.strip().splitlines()[-1])["recoveries"])


@case("ring_peer", timeout_s=180)
def _peer_killed_fail_fast(ws):
  return classify(_ring_with_fault(ws, "kill", ["--on-peer-failure", "fail"]))


@case("ring_peer", timeout_s=180)
def _peer_frozen_times_out(ws):
  t0 = time.perf_counter()
  o = classify(_ring_with_fault(ws, "stop", ["--peer-timeout", "3"]))
  if o.kind == "clear_error" and time.perf_counter() - t0 > 60:
    o.kind, o.detail = "hang", f"took {time.perf_counter() - t0:.0f} s for a 3 s peer timeout"
  return o


# ------------------------------------------------------------------------------------------ export

def _digest(path):
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


@case("export")
def _export_fails_mid_write(ws):
  """The disk fills while writing tensors: one error line, and the file that was at --out is unchanged."""
  import gguf
  dst = ws.path("existing.gguf")
  with open(ws.good, "rb") as f, open(dst, "wb") as g:
    g.write(f.read())
  before = _digest(dst)
  orig = gguf.GGUFWriter.write_tensors_to_file

  def full_disk(self, *a, **k):
    raise OSError(28, "No space left on device")
  gguf.GGUFWriter.write_tensors_to_file = full_disk
  try:
    o = run_cli("ondevice.export", ["--from-gguf", ws.good, "--out", dst, "--quant", "q8_0"])
  finally:
    gguf.GGUFWriter.write_tensors_to_file = orig
  o.data_lost = _digest(dst) != before or os.path.exists(dst + ".partial")
  return o


@case("export")
def _export_from_corrupt_file(ws):
  dst = ws.path("existing2.gguf")
  with open(ws.good, "rb") as f, open(dst, "wb") as g:
    g.write(f.read())
  before = _digest(dst)
  bad = ws.copy_with("e-bad.gguf", lambda d: d[: len(d) // 2])
  o = run_cli("ondevice.export", ["--from-gguf", bad, "--out", dst, "--quant", "q8_0"])
  o.data_lost = _digest(dst) != before
  return o


@case("export", timeout_s=300)
def _export_workdir_whose_config_does_not_match(ws):
  """A training workdir whose config.json was rewritten for another width than its checkpoint: refused in one
  line, and no GGUF written (its header would claim one width over weights of another)."""
  import dataclasses
  import jax
  from framework import checkpoint as ckpt_lib
  from framework import config as config_lib
  from ondevice import sources
  wd, out = ws.path("wd-mismatch"), ws.path("mismatch.gguf")
  cfg = sources.config_from_file(os.path.join(ROOT, "experiments/configs/quickstart.py:runlocal=True"))
  from flax.core import meta
  params = meta.unbox(sources.random_params(cfg))
  ck = ckpt_lib.Checkpointer(wd, config_lib.CheckpointConfig(every=1, keep=2, async_save=False))
  ck.save(2, {"params": params, "step": jax.numpy.int32(2)}, {"step": 2}, force=True)
  ck.close()
  other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=2 * cfg.model.d_model))
  with open(os.path.join(wd, "config.json"), "w") as f:
    json.dump(config_lib.to_dict(other), f, default=str)
  o = run_cli("ondevice.export", ["--workdir", wd, "--out", out, "--quant", "q8_0"])
  o.data_lost = os.path.exists(out)
  return o


@case("export")
def _export_unknown_quant(ws):
  return run_cli("ondevice.export", ["--from-gguf", ws.good, "--out", ws.path("x.gguf"), "--quant", "q3_k"])


@case("export")
def _export_keep_too_many_layers(ws):
  return run_cli("ondevice.export", ["--from-gguf", ws.good, "--keep-layers", "9", "--out", ws.path("y.gguf")])
