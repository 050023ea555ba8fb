"""Single device: our engine vs llama.cpp on the same mmap'd GGUF, the same token stream, 1 and 2 threads.

Engines (``run``): ours (planes, ``planes.set_threads(n)``); llama.cpp through its C API (llama-cpp-python's
low-level bindings: one ``llama_decode`` per token, no Python-side sampling or logits copies) in its
exact-arithmetic configuration (f32 KV cache, flash attention off) and in its default one (f16 KV cache,
flash attention auto), each with n_threads = n_threads_batch = n.

Same stream: the greedy continuation of the prompt is decoded once; then every engine is fed exactly that
stream (teacher forcing), in turns of 8 tokens per engine (``paired``), so all do the same work and load drift
on this shared machine hits all alike. Reported per engine: median per-token time over all steps of all rounds, its
IQR, each round's median (their spread is the noise floor), prefill tokens/s, and whether the engine's own
argmax followed the stream at every step (ours and llama.cpp's exact configuration must; the default
configuration's f16 KV cache may not).
"""
from __future__ import annotations

import ctypes
import os
import statistics
import time

import numpy as np


class Ours:
  name = "ours"

  def __init__(self, path: str, ctx: int, threads: int):
    from ondevice import planes
    from ondevice.forward import GGUFLlama
    from ondevice.weights import MappedGGUF
    self.threads = threads
    self.m = GGUFLlama(MappedGGUF(path), max_len=ctx)
    planes.set_threads(threads)
    self.m.forward(list(b"warm"), 0, self.m.new_cache())  # compile / load kernels outside the timing

  def _threads(self):
    from ondevice import planes
    planes.set_threads(self.threads)

  def prefill(self, prompt):
    self._threads()
    self.c, self.pos = self.m.new_cache(), len(prompt)
    return self.m.forward(prompt, 0, self.c, last_only=True)[-1]

  def step(self, tok):
    self._threads()
    logits = self.m.forward([tok], self.pos, self.c)[-1]
    self.pos += 1
    return logits


class LlamaCpp:
  """llama.cpp's C API: a context per configuration; ``exact``: f32 KV, flash attention off."""

  def __init__(self, model, ctx: int, threads: int, exact: bool):
    import llama_cpp as L
    self.L = L
    self.name = "llama_cpp_exact" if exact else "llama_cpp_default"
    p = L.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch = ctx, ctx, ctx
    p.n_threads = p.n_threads_batch = threads
    if exact:
      p.type_k = p.type_v = 0  # GGML_TYPE_F32
      p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    self.ctx = L.llama_init_from_model(model, p)
    self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    self.config = ("f32 KV, flash attention off" if exact else "defaults: f16 KV, flash attention auto") + \
        f", n_threads {threads}"
    self.prefill(list(b"warm"))

  def _decode(self, toks):
    arr = (ctypes.c_int32 * len(toks))(*toks)
    if self.L.llama_decode(self.ctx, self.L.llama_batch_get_one(arr, len(toks))) != 0:
      raise RuntimeError("llama_decode failed")
    return np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))

  def prefill(self, prompt):
    self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
    return self._decode(prompt).copy()

  def step(self, tok):
    return self._decode([tok])

  def close(self):
    self.L.llama_free(self.ctx)


def _pct(ts, q):
  return 1e3 * float(np.percentile(ts, q))


def paired(engines: list, prompt: list, stream: list, rounds: int, block: int = 8) -> dict:
  """Every engine decodes ``stream`` after ``prompt``, in turns of ``block`` tokens (rotating who goes first):
  short enough that load drift hits all alike, long enough that one engine's idle threads (still polling
  after its turn) rarely overlap another engine's timed tokens."""
  st = {e.name: {"ts": [], "round_medians": [], "prefill_s": [], "followed": True} for e in engines}
  for r in range(rounds):
    order = engines[r % len(engines):] + engines[:r % len(engines)]
    last = {}
    for e in order:
      t0 = time.perf_counter()
      last[e.name] = int(np.argmax(e.prefill(prompt)))
      st[e.name]["prefill_s"].append(time.perf_counter() - t0)
    ts = {e.name: [] for e in engines}
    for b0 in range(0, len(stream), block):
      for e in order:
        for tok in stream[b0:b0 + block]:
          if last[e.name] != tok:
            st[e.name]["followed"] = False
          t0 = time.perf_counter()
          logits = e.step(tok)
          ts[e.name].append(time.perf_counter() - t0)
          last[e.name] = int(np.argmax(logits))
    for name, v in ts.items():
      st[name]["ts"] += v
      st[name]["round_medians"].append(1e3 * statistics.median(v))
  out = {}
  for name, s in st.items():
    out[name] = {"tpot_ms": 1e3 * statistics.median(s["ts"]), "tpot_iqr_ms": [_pct(s["ts"], 25), _pct(s["ts"], 75)],
                 "round_medians_ms": [round(v, 3) for v in s["round_medians"]],
                 "prefill_tok_s": len(prompt) / statistics.median(s["prefill_s"]), "followed_stream": s["followed"]}
  return out


def run(path: str, prompt: list, n: int, threads=(1, 2), rounds: int = 3) -> dict:
  """{'threads_N': {...}} for each thread count; llama.cpp entries are skipped (with a reason) if missing.
  ``llama_cpp_build`` records how the peer was built (version, llama.cpp's system info line: the vector
  extensions its kernels use), so the strength of the baseline is part of the result. A peer that crashes in
  a child's smoke decode raises ``peer.PeerCrash`` before anything is timed."""
  from ondevice import peer, planes
  ctx = -(-(len(prompt) + n + 8) // 256) * 256
  try:
    import llama_cpp as L
  except ImportError:
    L = None
  model = None
  build = None
  if L is not None:
    smoke = peer.checked()
    if not smoke.ok:
      raise peer.PeerCrash(smoke.line)
    build = peer.system_info()
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mp)
  res = {"prompt_tokens": len(prompt), "stream_tokens": n, "rounds": rounds, "ctx": ctx,
         "load_avg_start": os.getloadavg()[0], "llama_cpp_build": build}
  try:
    for th in threads:
      ours = Ours(path, ctx, th)
      c = ours.m.new_cache()
      logits = ours.m.forward(prompt, 0, c, last_only=True)[-1]
      stream = []
      for i in range(n):  # our greedy stream (== llama.cpp's in the exact configuration: tested)
        stream.append(int(np.argmax(logits)))
        logits = ours.m.forward([stream[-1]], len(prompt) + i, c)[-1]
      engines = [ours]
      if model is not None:
        engines += [LlamaCpp(model, ctx, th, True), LlamaCpp(model, ctx, th, False)]
      r = paired(engines, prompt, stream, rounds)
      row = {"ours": r["ours"], "stream": bytes(t for t in stream if t < 256).decode("utf-8", "replace")}
      if model is None:
        row["llama_cpp"] = {"skipped": "llama-cpp-python not installed (.ci/llama_cpp_wheel.sh builds one for this CPU)"}
      else:
        for e in engines[1:]:
          row[e.name] = dict(r[e.name], config=e.config)
          e.close()
        a = r["ours"]
        for k in ("llama_cpp_exact", "llama_cpp_default"):
          b = r[k]
          row[f"ratio_ours_over_{k}"] = a["tpot_ms"] / b["tpot_ms"]
          row[f"ratio_per_round_{k}"] = [round(x / y, 3) for x, y in zip(a["round_medians_ms"], b["round_medians_ms"])]
        row["same_greedy_tokens_exact_config"] = a["followed_stream"] and r["llama_cpp_exact"]["followed_stream"]
      res[f"threads_{th}"] = row
  finally:
    planes.set_threads(1)
    if model is not None:
      L.llama_model_free(model)
  res["load_avg_end"] = os.getloadavg()[0]
  return res
