"""The ``serve`` class of ondevice bad-input cases: ``ondevice.serve`` on loopback under load and bad requests.

* 100 concurrent requests (chat and completions, streamed and not): every one answered 200, and its greedy
  text equal to the same request made alone ('recovered', checked);
* 20 malformed requests (bad JSON, wrong types, unknown model, context overflow, unknown path or method, no
  length, an oversized body, unsupported options...): each its 4xx status with an OpenAI-style error message,
  and a good request answered after them ('clear_error');
* the CLI started on a file that is not there, or on a port that is taken: one ``error:`` line.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading

from benchmarks.reliability.ondevice_area import Outcome, case, run_cli

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def chat_model(ws) -> str:
  """The workspace's tiny model (byte vocabulary) with a chat template, Q8_0."""
  from ondevice import vocab
  from ondevice.gguf_io import write_arrays
  v = vocab.byte_vocab(ws.cfg.vocab_size)
  v.chat_template = CHATML
  return ws.make("serve-q8_0.gguf", lambda p: write_arrays(ws.arrays, ws.cfg, p, "q8_0", vocab=v))


def _server(ws):
  from ondevice import serve
  srv, svc = serve.serve(chat_model(ws), "127.0.0.1", 0, ctx=256, name="tiny")
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  return srv, svc


def _request(port: int, method: str, path: str, body=None, headers=None, timeout: float = 120.0) -> tuple:
  """(status, body bytes) of one raw HTTP request (``body``: bytes, or an object sent as JSON)."""
  c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
  try:
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    if data is not None and "Content-Length" not in h:
      h["Content-Length"] = str(len(data))
    c.putrequest(method, path)
    for k, v in h.items():
      if v is not None:
        c.putheader(k, v)
    c.endheaders()
    if data:
      c.send(data)
    r = c.getresponse()
    return r.status, r.read()
  finally:
    c.close()


def _text(raw: bytes, chat: bool, stream: bool) -> str:
  if not stream:
    ch = json.loads(raw)["choices"][0]
    return ch["message"]["content"] if chat else ch["text"]
  out = []
  for line in raw.decode().splitlines():
    if line.startswith("data: ") and line != "data: [DONE]":
      ch = json.loads(line[6:])["choices"][0]
      out.append((ch["delta"].get("content") or "") if chat else ch["text"])
  assert raw.rstrip().endswith(b"data: [DONE]")
  return "".join(out)


REQUESTS = [(True, {"messages": [{"role": "user", "content": "def f(x):"}]}),
            (False, {"prompt": "import os\n"}),
            (True, {"messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]}),
            (False, {"prompt": "class A:\n  "})]


@case("serve", timeout_s=600)
def _concurrent_requests(ws):
  srv, svc = _server(ws)
  port = srv.server_address[1]
  try:
    def body(i, stream):
      chat, req = REQUESTS[i % len(REQUESTS)]
      return chat, dict(req, model="tiny", max_tokens=12, temperature=0, stream=stream)

    ref = {}
    for i in range(len(REQUESTS)):
      chat, b = body(i, False)
      st, raw = _request(port, "POST", "/v1/chat/completions" if chat else "/v1/completions", b)
      if st != 200:
        return Outcome("crash", f"a single request got {st}: {raw[:200]!r}")
      ref[i] = _text(raw, chat, False)
    results = [None] * 100

    def one(i):
      chat, b = body(i, i % 3 == 0)
      try:
        st, raw = _request(port, "POST", "/v1/chat/completions" if chat else "/v1/completions", b, timeout=500)
        results[i] = (st, _text(raw, chat, b["stream"]) if st == 200 else raw[:120])
      except Exception as e:  # noqa: BLE001 - reported below
        results[i] = (0, f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(100)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(550)
    bad = [(i, r) for i, r in enumerate(results) if r is None or r[0] != 200]
    if bad:
      return Outcome("crash", f"{len(bad)} of 100 concurrent requests failed, e.g. {bad[0]}")
    wrong = [i for i, r in enumerate(results) if r[1] != ref[i % len(REQUESTS)]]
    if wrong:
      return Outcome("silent", f"{len(wrong)} of 100 answers differ from the same request made alone")
    st, _ = _request(port, "GET", "/health")
    return Outcome("recovered", f"100 concurrent requests (34 streamed): all 200, each text equal to the request "
                                f"made alone; health {st}")
  finally:
    srv.shutdown()
    srv.server_close()
    svc.close()


def malformed(ctx: int = 256) -> list:
  """(what, method, path, body, headers, expected status): the 20 malformed requests."""
  msg = [{"role": "user", "content": "hi"}]
  long = "x" * (ctx + 10)
  return [
      ("body not JSON", "POST", "/v1/chat/completions", b"{not json", None, 400),
      ("body a JSON list", "POST", "/v1/chat/completions", b"[1, 2]", None, 400),
      ("body not UTF-8", "POST", "/v1/completions", b"\xff\xfe\x00", None, 400),
      ("empty body", "POST", "/v1/completions", b"", None, 400),
      ("unknown model", "POST", "/v1/chat/completions", {"model": "gpt-9", "messages": msg}, None, 404),
      ("no messages", "POST", "/v1/chat/completions", {"model": "tiny"}, None, 400),
      ("message without role", "POST", "/v1/chat/completions", {"messages": [{"content": "x"}]}, None, 400),
      ("content a number", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None, 400),
      ("prompt over the context", "POST", "/v1/completions", {"prompt": long}, None, 400),
      ("max_tokens over the context", "POST", "/v1/chat/completions", {"messages": msg, "max_tokens": ctx}, None, 400),
      ("max_tokens a string", "POST", "/v1/completions", {"prompt": "a", "max_tokens": "ten"}, None, 400),
      ("max_tokens 0", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 0}, None, 400),
      ("temperature negative", "POST", "/v1/completions", {"prompt": "a", "temperature": -1}, None, 400),
      ("n = 2", "POST", "/v1/completions", {"prompt": "a", "n": 2}, None, 400),
      ("token id out of range", "POST", "/v1/completions", {"prompt": [1, 99999]}, None, 400),
      ("logprobs asked", "POST", "/v1/completions", {"prompt": "a", "logprobs": 5}, None, 400),
      ("unknown path", "POST", "/v1/embeddings", {"input": "a"}, None, 404),
      ("GET on a POST route", "GET", "/v1/chat/completions", None, None, 405),
      ("no Content-Length", "POST", "/v1/completions", None, {"Content-Length": None}, 411),
      ("body over 1 MiB", "POST", "/v1/completions", None, {"Content-Length": str(2 << 20)}, 413),
  ]


@case("serve", timeout_s=300)
def _malformed_requests(ws):
  srv, svc = _server(ws)
  port = srv.server_address[1]
  try:
    wrong = []
    for what, method, path, body, headers, want in malformed(svc.ctx):
      st, raw = _request(port, method, path, body, headers)
      try:
        err = json.loads(raw)["error"]
        ok = st == want and isinstance(err.get("message"), str) and err["message"]
      except (ValueError, KeyError, TypeError):
        ok = False
      if not ok:
        wrong.append(f"{what}: {st} (want {want}) {raw[:80]!r}")
    st, raw = _request(port, "POST", "/v1/completions", {"prompt": "def ", "max_tokens": 4, "temperature": 0})
    if st != 200:
      wrong.append(f"a good request after them: {st} {raw[:80]!r}")
    if wrong:
      return Outcome("unclear_error", "; ".join(wrong)[:300])
    return Outcome("clear_error", f"error: {len(malformed())} malformed requests got their 4xx status and a message; "
                                  f"a good request after them was answered (fix the request)")
  finally:
    srv.shutdown()
    srv.server_close()
    svc.close()


@case("serve")
def _serve_missing_model(ws):
  return run_cli("ondevice.serve", ["--model", ws.path("no-such-model.gguf"), "--port", "0"])


@case("serve")
def _serve_port_taken(ws):
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  s.listen(1)
  try:
    return run_cli("ondevice.serve", ["--model", chat_model(ws), "--port", str(s.getsockname()[1])])
  finally:
    s.close()
