"""Tokenizers: the byte-level default, a Hugging Face ``tokenizer.json`` or a SentencePiece ``.model``
(``data.tokenizer``).

Why bytes by default: no training, no download, no unknown tokens, exact round trip, and loss in nats per
token is loss per byte, which makes runs with different corpora directly comparable. A uniform
model starts at ln(256) = 5.55 nats/byte.

A ``tokenizer.json`` (any model the ``tokenizers`` library reads: BPE, WordPiece, Unigram) is applied without
its post-processor (``add_special_tokens=False``): the data pipeline places the one special token it uses, the
end-of-document token (:attr:`Tokenizer.eos_id`), itself (framework/documents.py). A SentencePiece model (Llama 2,
Mistral, Gemma vocabularies) is applied the same way: pieces without BOS / EOS, its own ``</s>`` ending documents.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Iterable, List, Sequence

import numpy as np
import tokenizers

from framework.config import ConfigError

VOCAB_SIZE = 256
# Names of end-of-text tokens in common tokenizer.json files, tried in this order (data.eos_token overrides).
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
ACCEPTED = ("'bytes', the path of a Hugging Face tokenizer.json (or of a folder holding one) or of a SentencePiece "
            ".model")


def encode(text: str) -> np.ndarray:
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(ids: Iterable[int]) -> str:
  return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


class Bytes:
  """Token id = UTF-8 byte. Documents are separated by byte 0 (NUL), which text does not contain."""
  name, vocab_size, eos_id, fingerprint = "bytes", VOCAB_SIZE, 0, "bytes"

  def encode(self, text: str) -> np.ndarray:
    return encode(text)

  def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
    return [encode(t) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    return decode(ids)


class HF:
  """A ``tokenizers.Tokenizer`` read from ``path``; ``eos_id`` is ``eos_token``'s id, or the first of
  :data:`EOS_NAMES` the vocabulary holds."""

  def __init__(self, path: pathlib.Path, eos_token: str = ""):
    try:
      self.tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library's parse errors: say which file and what is accepted
      first = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise ConfigError(f"data.tokenizer={str(path)!r} is not a tokenizer.json the tokenizers library reads "
                        f"({first}); pass {ACCEPTED}") from None
    self.name = str(path)
    self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
    names = (eos_token,) if eos_token else EOS_NAMES
    ids = [self.tok.token_to_id(n) for n in names]
    found = [i for i in ids if i is not None]
    if not found:
      raise ConfigError(f"data.tokenizer={self.name!r} has no token {eos_token!r}" if eos_token else
                        f"data.tokenizer={self.name!r} has none of the end-of-text tokens {list(EOS_NAMES)}: set "
                        f"--config.data.eos_token to the token that ends a document in this vocabulary")
    self.eos_id = int(found[0])
    self.fingerprint = f"{path.name}:{self.vocab_size}:{self.eos_id}:{hash_file(path)}"

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
    return [np.asarray(e.ids, dtype=np.int32) for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int]) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePiece:
  """A SentencePiece model read from ``path`` (the ``sentencepiece`` library); ``eos_id`` is ``eos_token``'s id, or
  the model's own end-of-sequence id."""

  def __init__(self, path: pathlib.Path, eos_token: str = ""):
    import sentencepiece  # noqa: PLC0415 (only SentencePiece vocabularies need it)
    self.sp = sentencepiece.SentencePieceProcessor()
    try:
      self.sp.Load(str(path))
    except Exception as e:  # noqa: BLE001 - the library's parse errors: say which file and what is accepted
      first = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise ConfigError(f"data.tokenizer={str(path)!r} is not a SentencePiece model ({first}); pass {ACCEPTED}") \
          from None
    self.name = str(path)
    self.vocab_size = int(self.sp.GetPieceSize())
    if eos_token:
      eos = self.sp.PieceToId(eos_token)
      if eos == self.sp.unk_id() and eos_token != self.sp.IdToPiece(self.sp.unk_id()):
        raise ConfigError(f"data.tokenizer={self.name!r} has no token {eos_token!r}")
    else:
      eos = self.sp.eos_id()
      if eos < 0:
        raise ConfigError(f"data.tokenizer={self.name!r} defines no end-of-sequence token: set "
                          f"--config.data.eos_token to the piece that ends a document in this vocabulary")
    self.eos_id = int(eos)
    self.fingerprint = f"{path.name}:{self.vocab_size}:{self.eos_id}:{hash_file(path)}"

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.sp.EncodeAsIds(text), dtype=np.int32)

  def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
    return [np.asarray(ids, dtype=np.int32) for ids in self.sp.EncodeAsIds(list(texts))]

  def decode(self, ids: Iterable[int]) -> str:
    return self.sp.DecodeIds([int(i) for i in ids])


def hash_file(path: pathlib.Path) -> str:
  return hashlib.sha1(path.read_bytes()).hexdigest()[:12]


def load(spec: str, eos_token: str = ""):
  """``data.tokenizer`` -> a tokenizer (:class:`Bytes`, :class:`HF` or :class:`SentencePiece`); a bad path is a
  one-line ConfigError."""
  if spec == "bytes":
    if eos_token:
      raise ConfigError(f"data.eos_token={eos_token!r} names a token of a tokenizer.json; the byte tokenizer "
                        "ends documents with byte 0: leave data.eos_token empty")
    return Bytes()
  p = pathlib.Path(os.path.expanduser(spec))
  if p.is_dir() and (p / "tokenizer.json").is_file():
    p = p / "tokenizer.json"
  if not p.is_file():
    raise ConfigError(f"data.tokenizer={spec!r}: {p} does not exist; pass {ACCEPTED}")
  if p.suffix == ".model":
    return SentencePiece(p, eos_token)
  return HF(p, eos_token)


def check_vocab(tok, vocab_size: int) -> None:
  """The model's embedding must have a row for every id the tokenizer emits."""
  if vocab_size < tok.vocab_size:
    raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the vocabulary of data.tokenizer="
                      f"{tok.name!r} ({tok.vocab_size} ids): set --config.model.vocab_size={tok.vocab_size} or more")
