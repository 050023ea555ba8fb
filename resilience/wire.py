"""Messages on the wire: one JSON header frame, then optional raw payload frames (pyzmq).

ZeroMQ gives us reconnecting sockets, atomic multipart delivery (a sender that dies mid-message
delivers nothing, so a half-sent replica can never be mistaken for a whole one) and zero-copy
sends from shared memory. Everything else (who talks to whom) is in agent.py / controller.py.
"""
from __future__ import annotations

import json
import socket
import time
from typing import Optional, Sequence

import zmq


def encode(msg: dict) -> bytes:
  return json.dumps(msg, separators=(",", ":")).encode()


def decode(frame) -> dict:
  return json.loads(bytes(frame.buffer if hasattr(frame, "buffer") else frame))


def send(sock: zmq.Socket, msg: dict, payload: Sequence = (), ident: Optional[bytes] = None) -> None:
  frames = ([ident] if ident is not None else []) + [encode(msg)] + list(payload)
  sock.send_multipart(frames, copy=len(payload) == 0)


def recv(sock: zmq.Socket, router: bool = False):
  """Returns (ident or None, msg, payload frames)."""
  frames = sock.recv_multipart(copy=False)
  ident = bytes(frames[0].buffer) if router else None
  rest = frames[1:] if router else frames
  return ident, decode(rest[0]), rest[1:]


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def bind_random(sock: zmq.Socket, host: str = "127.0.0.1") -> str:
  port = sock.bind_to_random_port(f"tcp://{host}")
  return f"tcp://{host}:{port}"


def now() -> float:
  """Wall clock shared by all processes on one host (recovery breakdowns subtract these)."""
  return time.time()


def new_socket(ctx: zmq.Context, kind: int, linger_ms: int = 0) -> zmq.Socket:
  s = ctx.socket(kind)
  s.setsockopt(zmq.LINGER, linger_ms)
  return s
