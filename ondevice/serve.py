"""python -m ondevice.serve --model model.gguf [--host 127.0.0.1] [--port 8080] [--ctx 2048] [--threads N]
                           [--devices devices.yaml] [--name NAME]

An OpenAI-compatible HTTP server over one model: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``"stream": true`` sends server-sent events, ending in ``data: [DONE]``), and
``GET /health``. Text goes through the file's own tokenizer and chat template; decoding is ``ondevice.generate``
(greedy at temperature 0, bit-identical to llama.cpp's greedy stream; else ``sampling.py``). With ``--devices``
the model runs on the pipelined ring of ondevice.run (Halda's plan), else on this machine.

Why the standard library's ThreadingHTTPServer: the model computes one request at a time (one KV cache; requests
wait for it in arrival order, at most ``--max-queue``), so an asynchronous framework would add a dependency and
buy nothing; a thread per connection holds a waiting or streaming client. Every prompt is prefilled from
scratch (no prefix reuse), so a response does not depend on earlier requests.

Bad requests get a 4xx status and an OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` body
(bad JSON 400, unknown model 404, context overflow 400 ``context_length_exceeded``, unknown path 404, wrong
method 405, missing length 411, body over 1 MiB 413, queue full 503), and the server keeps serving.
"""
from __future__ import annotations

import argparse
import codecs
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

MAX_BODY = 1 << 20


class HTTPError(Exception):
  def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
    super().__init__(message)
    self.status, self.param, self.code = status, param, code

  def body(self) -> dict:
    kind = "invalid_request_error" if self.status < 500 else "server_error"
    return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def _num(req: dict, key: str, default, kind=float, lo=None, hi=None):
  v = req.get(key, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
    raise HTTPError(400, f"'{key}' must be a{'n integer' if kind is int else ' number'}", key)
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    raise HTTPError(400, f"'{key}' must be within [{lo}, {hi}]", key)
  return kind(v)


class Service:
  """The model, its tokenizer and chat template, and the lock that runs one generation at a time."""

  def __init__(self, model: str, name: Optional[str] = None, ctx: int = 2048, devices: Optional[str] = None,
               max_queue: int = 256):
    import os
    from ondevice import chat, gguf_check, run
    from ondevice import vocab as vocab_lib
    from ondevice.gguf_io import read_info
    info = read_info(model)
    gguf_check.check_runnable(info)
    self.vocab = vocab_lib.load(model)
    self.chat = chat.Chat(self.vocab)
    self.name = name or os.path.splitext(os.path.basename(model))[0]
    self.ctx = min(ctx, info.cfg.max_seq_len) if ctx > 0 else info.cfg.max_seq_len
    self.engine, self.plan = run.build_engine(model, devices, ctx=self.ctx)
    self.lock = threading.Lock()
    self.waiting = 0
    self.max_queue = max_queue
    self.created = int(time.time())
    self._qlock = threading.Lock()

  def close(self) -> None:
    self.engine.close()

  # ------------------------------------------------------------------ requests
  def params(self, req: dict):
    from ondevice import sampling
    if req.get("n", 1) != 1:
      raise HTTPError(400, "only n=1 is supported", "n")
    for key in ("logprobs", "top_logprobs", "tools", "functions", "response_format"):
      if req.get(key) not in (None, False, [], {"type": "text"}):
        raise HTTPError(400, f"'{key}' is not supported by this server", key)
    p = sampling.SamplingParams(
        temperature=_num(req, "temperature", 1.0, float, 0.0, 2.0), top_k=_num(req, "top_k", 40, int, 0),
        top_p=_num(req, "top_p", 1.0, float, 0.0, 1.0), min_p=_num(req, "min_p", 0.05, float, 0.0, 1.0),
        repeat_penalty=_num(req, "repeat_penalty", 1.0, float, 0.01, 10.0), seed=_num(req, "seed", None, int))
    if p.top_p <= 0:
      raise HTTPError(400, "'top_p' must be > 0", "top_p")
    stop = req.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
      raise HTTPError(400, "'stop' must be a non-empty string or a list of at most 4 of them", "stop")
    return p, stop

  def check_model(self, req: dict) -> None:
    m = req.get("model")
    if m is not None and m != self.name:
      raise HTTPError(404, f"the model '{m}' does not exist; this server serves '{self.name}' (GET /v1/models)",
                      "model", "model_not_found")

  def budget(self, req: dict, prompt: list, default: Optional[int]) -> int:
    if not prompt:
      raise HTTPError(400, "the prompt is empty", "prompt")
    room = self.ctx - len(prompt)
    n = req.get("max_completion_tokens", req.get("max_tokens"))
    n = _num({"max_tokens": n}, "max_tokens", min(default, max(room, 1)) if default else max(room, 1), int, 1)
    if n > room:
      fix = "shorten the prompt" if room < 1 else f"shorten the prompt or lower max_tokens to {room}"
      raise HTTPError(400, f"this model's context is {self.ctx} tokens; the prompt has {len(prompt)} and max_tokens "
                      f"asks for {n} more: {fix}", "messages" if "messages" in req else "prompt",
                      "context_length_exceeded")
    return n

  def generate(self, prompt: list, n_new: int, params, stop: list, on_text=None) -> tuple:
    """(text, finish_reason, completion tokens); ``on_text(delta) -> True`` stops (a client that went away)."""
    from ondevice import generate, sampling
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    st8 = {"text": "", "sent": 0, "finish": "length", "n": 0, "hit": False}
    hold = max((len(x) for x in stop), default=1) - 1  # text that may still become a stop string is held back

    def on_token(tok: int) -> bool:
      st8["n"] += 1
      st8["text"] += dec.decode(self.vocab.piece(tok))
      hit = min((i for i in (st8["text"].find(x) for x in stop) if i >= 0), default=-1)
      if hit >= 0:
        st8["text"], st8["finish"], st8["hit"] = st8["text"][:hit], "stop", True
      end = len(st8["text"]) - (0 if hit >= 0 else hold)
      if on_text and end > st8["sent"]:
        if on_text(st8["text"][st8["sent"]:end]):
          st8["finish"] = "cancelled"
          return True
        st8["sent"] = end
      return hit >= 0

    with self._qlock:
      if self.waiting >= self.max_queue:
        raise HTTPError(503, f"{self.waiting} requests are waiting; retry later", None, "queue_full")
      self.waiting += 1
    try:
      with self.lock:
        sampler = None if params.greedy and params.repeat_penalty == 1 else sampling.Sampler(params)
        res = generate.greedy(self.engine, prompt, n_new, self.vocab.eog, on_token, sampler)
    finally:
      with self._qlock:
        self.waiting -= 1
    if not st8["hit"]:
      st8["text"] += dec.decode(b"", True)  # an unfinished character at the end becomes U+FFFD
      if st8["finish"] == "length" and len(res.tokens) < n_new:
        st8["finish"] = "stop"  # an end-of-generation token
    if on_text and st8["finish"] != "cancelled" and len(st8["text"]) > st8["sent"]:
      on_text(st8["text"][st8["sent"]:])
    return st8["text"], st8["finish"], st8["n"]

  def completion_prompt(self, req: dict) -> list:
    p = req.get("prompt")
    if isinstance(p, list) and len(p) == 1:
      p = p[0]
    if isinstance(p, str):
      return self.vocab.encode(p, add_special=True)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
      if not all(0 <= t < self.vocab.n_tokens for t in p):
        raise HTTPError(400, f"prompt token ids must be in [0, {self.vocab.n_tokens})", "prompt")
      return list(p)
    raise HTTPError(400, "'prompt' must be a string, a list of one string, or a list of token ids", "prompt")

  def chat_prompt(self, req: dict) -> list:
    from ondevice.chat import ChatError
    try:
      return self.chat.tokens(req.get("messages"))
    except ChatError as e:
      raise HTTPError(400, str(e), "messages") from None


class Handler(BaseHTTPRequestHandler):
  server_version = "prismllm-ondevice"
  svc: Service = None  # set by serve()

  def log_message(self, fmt, *args):  # one line per request on stderr, without the default's noise
    sys.stderr.write(f"{self.command} {self.path} {args[1] if len(args) > 1 else ''}\n")

  def _send_json(self, status: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _fail(self, e: HTTPError) -> None:
    try:
      self._send_json(e.status, e.body())
    except OSError:
      pass

  def do_GET(self):
    try:
      if self.path in ("/v1/models", "/models"):
        s = self.svc
        self._send_json(200, {"object": "list", "data": [{"id": s.name, "object": "model", "created": s.created,
                                                          "owned_by": "prismllm", "context_length": s.ctx}]})
      elif self.path == "/health":
        self._send_json(200, {"status": "ok", "waiting": self.svc.waiting})
      elif self.path in ("/v1/completions", "/v1/chat/completions"):
        raise HTTPError(405, f"{self.path} takes POST")
      else:
        raise HTTPError(404, f"no route {self.path}; see GET /v1/models")
    except HTTPError as e:
      self._fail(e)

  def do_POST(self):
    try:
      if self.path not in ("/v1/completions", "/v1/chat/completions", "/completions", "/chat/completions"):
        raise HTTPError(404 if self.path != "/v1/models" else 405, f"no POST route {self.path}")
      req = self._body()
      self._complete(req, chat=self.path.endswith("chat/completions"))
    except HTTPError as e:
      self._fail(e)
    except (BrokenPipeError, ConnectionResetError):
      pass
    except Exception as e:  # noqa: BLE001 - a bug must answer 500 and leave the server serving
      self._fail(HTTPError(500, f"internal error: {type(e).__name__}: {e}"))

  def _body(self) -> dict:
    n = self.headers.get("Content-Length")
    if n is None:
      raise HTTPError(411, "a Content-Length header is required")
    try:
      n = int(n)
    except ValueError:
      raise HTTPError(400, "Content-Length is not a number") from None
    if n > MAX_BODY:
      raise HTTPError(413, f"the body has {n} bytes; the limit is {MAX_BODY}")
    raw = self.rfile.read(n)
    try:
      req = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
      raise HTTPError(400, f"the body is not valid JSON ({e})") from None
    if not isinstance(req, dict):
      raise HTTPError(400, "the body must be a JSON object")
    return req

  def _complete(self, req: dict, chat: bool) -> None:
    s = self.svc
    s.check_model(req)
    params, stop = s.params(req)
    prompt = s.chat_prompt(req) if chat else s.completion_prompt(req)
    n_new = s.budget(req, prompt, None if chat else 16)
    stream = bool(req.get("stream", False))
    cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    base = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": s.name}

    def choice(text=None, finish=None, first=False):
      if chat:
        delta = ({"role": "assistant", "content": ""} if first else {}) if text is None else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": finish}
      return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    if not stream:
      text, finish, n = s.generate(prompt, n_new, params, stop)
      finish = "stop" if finish == "cancelled" else finish
      usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
      if chat:
        out = dict(base, object="chat.completion", choices=[{"index": 0, "finish_reason": finish, "logprobs": None,
                   "message": {"role": "assistant", "content": text}}], usage=usage)
      else:
        out = dict(base, choices=[choice(text, finish)], usage=usage)
      self._send_json(200, out)
      return
    self.send_response(200)
    self.send_header("Content-Type", "text/event-stream")
    self.send_header("Cache-Control", "no-cache")
    self.end_headers()

    def event(obj) -> bool:
      try:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()
        return False
      except OSError:
        return True  # the client went away: stop generating

    if chat:
      event(dict(base, choices=[choice(first=True)]))
    _, finish, n = s.generate(prompt, n_new, params, stop, lambda d: event(dict(base, choices=[choice(d)])))
    if finish != "cancelled":
      event(dict(base, choices=[choice(None if chat else "", finish)],
                 usage={"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}))
      try:
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
      except OSError:
        pass


class Server(ThreadingHTTPServer):
  daemon_threads = True
  request_queue_size = 512  # listen backlog: socketserver's 5 resets clients that connect at the same moment


def serve(model: str, host: str = "127.0.0.1", port: int = 8080, **kw):
  """(server, service): a bound ThreadingHTTPServer (port 0 picks a free one: server.server_address) over a
  loaded model; call server.serve_forever(). The port is bound first, so a taken port fails before loading."""
  from ondevice.errors import InputError
  handler = type("BoundHandler", (Handler,), {})
  try:
    srv = Server((host, port), handler)
  except OSError as e:
    raise InputError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); pick another port "
                     f"(--port 0 picks a free one)") from None
  try:
    handler.svc = svc = Service(model, **kw)
  except BaseException:
    srv.server_close()
    raise
  return srv, svc


def _main(args) -> int:
  from ondevice import planes
  if args.threads < 1:
    from ondevice.errors import InputError
    raise InputError(f"--threads {args.threads}: pass --threads >= 1")
  planes.set_threads(args.threads)
  srv, svc = serve(args.model, args.host, args.port, name=args.name, ctx=args.ctx, devices=args.devices,
                   max_queue=args.max_queue)
  print(json.dumps({"url": f"http://{srv.server_address[0]}:{srv.server_address[1]}/v1", "model": svc.name,
                    "ctx": svc.ctx, "plan": svc.plan}), flush=True)
  try:
    srv.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    srv.server_close()
    svc.close()
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m ondevice.serve", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", required=True)
  ap.add_argument("--host", default="127.0.0.1")
  ap.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed at start)")
  ap.add_argument("--ctx", type=int, default=2048, help="context tokens (at most the model's)")
  ap.add_argument("--threads", type=int, default=1)
  ap.add_argument("--devices", default=None, help="devices.yaml: serve from the pipelined ring")
  ap.add_argument("--name", default=None, help="the model id clients pass (default: the file name)")
  ap.add_argument("--max-queue", type=int, default=256, help="requests that may wait; more get 503")
  from ondevice.errors import cli
  return cli(_main, ap.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
