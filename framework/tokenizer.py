"""Byte-level tokenizer: token id = UTF-8 byte (vocab 256).

Why bytes: no training, no download, no unknown tokens, exact round trip, and loss in nats per
token is loss per byte, which makes runs with different corpora directly comparable. A uniform
model starts at ln(256) = 5.55 nats/byte.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

VOCAB_SIZE = 256


def encode(text: str) -> np.ndarray:
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(ids: Iterable[int]) -> str:
  return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")
