"""Training data: text corpora (random windows) and document datasets (packed windows, documents.py).

The default corpus is the Python standard library's own source, which ships with every Python, so
the quickstart needs no download. Users pass a text file or a folder instead (``data.corpus``), or a jsonl /
parquet document dataset (framework/documents.py); :func:`load` reads either through ``data.tokenizer``
(framework/tokenizer.py) and :func:`iterator` gives its checkpointable batch iterator.

Text-corpus batches are random windows whose offsets are a pure function of ``(seed, step)``: the iterator
state is one integer, so checkpoints restore the exact data position, a recovered run is
bit-identical, and each process computes only its own rows (``process_index`` slice of the global
batch) without any coordination.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import sysconfig
from typing import Any, Iterator, Optional

import numpy as np

from framework import documents
from framework import tokenizer as tokenizer_lib
from framework.config import Config, ConfigError, DataConfig


def _files(root: pathlib.Path, extensions) -> list:
  if root.is_file():
    return [root]
  skip = {"site-packages", "test", "tests", "__pycache__", "idlelib", "turtledemo"}
  return sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in extensions
                and not (skip & set(f.relative_to(root).parts)))


# A corpus file is text if at most these fractions of its bytes are NUL or lie outside valid UTF-8 (a byte-level
# model trains on anything, so a binary file would train without a word; latin-1 prose, a few % accented
# bytes, or a stray bad byte is fine).
MAX_NUL_FRACTION = 0.001
MAX_INVALID_UTF8_FRACTION = 0.10


def text_problem(raw: bytes) -> Optional[str]:
  """Why ``raw`` is not text (its NUL / invalid UTF-8 share above the limits), or None."""
  if not raw:
    return None
  nul = raw.count(0) / len(raw)
  bad = (len(raw) - len(raw.decode("utf-8", errors="ignore").encode("utf-8"))) / len(raw)  # bytes dropped
  if nul > MAX_NUL_FRACTION or bad > MAX_INVALID_UTF8_FRACTION:
    return (f"{nul:.1%} NUL bytes and {bad:.1%} invalid UTF-8 (text allows {MAX_NUL_FRACTION:.1%} and "
            f"{MAX_INVALID_UTF8_FRACTION:.0%})")
  return None



def corpus_path(cfg: DataConfig) -> pathlib.Path:
  if cfg.corpus == "stdlib":
    return pathlib.Path(sysconfig.get_paths()["stdlib"])
  return pathlib.Path(os.path.expanduser(cfg.corpus))


def _check_exists(cfg: DataConfig, root: pathlib.Path) -> None:
  if not root.exists():
    raise ConfigError(f"data.corpus={cfg.corpus!r}: {root} does not exist; pass a text file or folder "
                      f"(--config.data.corpus=/path), a .jsonl / .parquet file or folder, or 'stdlib'")


def load_corpus(cfg: DataConfig) -> np.ndarray:
  """Reads a text corpus into one uint8 array (files in sorted order, each preceded by its name); a file that
  is not text (:func:`text_problem`) is refused by name."""
  root = corpus_path(cfg)
  _check_exists(cfg, root)
  files = _files(root, tuple(cfg.extensions))
  if not files:
    raise ConfigError(f"data.corpus={cfg.corpus!r}: no files with extensions {cfg.extensions} under {root}")
  chunks, total = [], 0
  for f in files:
    try:
      raw = f.read_bytes()
    except OSError as e:
      raise ConfigError(f"data.corpus: cannot read {f}: {e}") from e
    raw = raw[: max(cfg.max_bytes - total, 0)]
    why = text_problem(raw)
    if why is not None:
      raise ConfigError(f"data.corpus={cfg.corpus!r}: {f} is not text ({why}): pass a text file or folder "
                        f"(--config.data.corpus=/path) or 'stdlib'")
    header = f"\n# file: {f.relative_to(root) if root.is_dir() else f.name}\n".encode()
    chunks += [header, raw]
    total += len(header) + len(raw)
    if total >= cfg.max_bytes:
      break
  data = np.frombuffer(b"".join(chunks)[: cfg.max_bytes], dtype=np.uint8)
  if data.size < 2 * (cfg.seq_len + 1):
    raise ConfigError(f"data.corpus={cfg.corpus!r} has {data.size} bytes, too few for seq_len={cfg.seq_len}")
  return data


@dataclasses.dataclass
class Split:
  """``train``: a token array (random windows, :class:`BatchIterator`) or a :class:`documents.Dataset` (packed
  windows, :class:`documents.PackedIterator`); ``eval``: a token array; ``tokenizer``: what made them."""
  train: Any
  eval: np.ndarray
  tokenizer: Any = None


def load(cfg: Config) -> Split:
  """The training data of ``cfg`` (``data.corpus`` through ``data.tokenizer``), checked against
  ``model.vocab_size``; every problem is a one-line ConfigError raised before anything is written."""
  d = cfg.data
  tok = tokenizer_lib.load(d.tokenizer, d.eos_token)
  tokenizer_lib.check_vocab(tok, cfg.model.vocab_size)
  root = corpus_path(d)
  _check_exists(d, root)
  kind = "text" if d.corpus == "stdlib" else documents.kind_of(root, d.format)
  if kind == "text":
    raw = load_corpus(d)
    ids = raw if d.tokenizer == "bytes" else tokenize_text(raw, tok)
    if ids.size < 2 * (d.seq_len + 1):
      raise ConfigError(f"data.corpus={d.corpus!r} has {ids.size} tokens, too few for seq_len={d.seq_len}")
    s = split(ids, d)
    return Split(s.train, s.eval, tok)
  ds = documents.open_dataset(root, kind, d, tok)
  ev = documents.load_eval(ds, d) if cfg.train.eval_every > 0 else np.zeros(0, np.int32)
  return Split(ds, ev, tok)


def tokenize_text(raw: np.ndarray, tok, piece_bytes: int = 1 << 16) -> np.ndarray:
  """A text corpus's bytes -> token ids, tokenized in pieces of about ``piece_bytes`` cut after a newline."""
  text = raw.tobytes().decode("utf-8", errors="replace")
  pieces, i = [], 0
  while i < len(text):
    j = text.find("\n", i + piece_bytes)
    j = len(text) if j < 0 else j + 1
    pieces.append(text[i:j])
    i = j
  ids = tok.encode_batch(pieces)
  dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
  return np.concatenate(ids).astype(dtype) if ids else np.zeros(0, dtype)


def iterator(split_: Split, cfg: DataConfig, step: int = 0, **kw):
  """The checkpointable batch iterator of ``split_.train`` (``kw``: seed_offset, process_index,
  process_count, rows as :class:`BatchIterator` takes them)."""
  if isinstance(split_.train, documents.Dataset):
    return documents.PackedIterator(split_.train, cfg, step=step, **kw)
  return BatchIterator(split_.train, cfg, step=step, **kw)


def split(data: np.ndarray, cfg: DataConfig) -> Split:
  n_eval = max(int(data.size * cfg.eval_fraction), 2 * (cfg.seq_len + 1))
  return Split(train=data[:-n_eval], eval=data[-n_eval:])


def batch_at(data: np.ndarray, step: int, cfg: DataConfig, seed_offset: int = 0,
             process_index: int = 0, process_count: int = 1, rows: Optional[slice] = None) -> dict:
  """The rows of global batch ``step`` owned by this process: {'inputs', 'targets'} int32 BxT.
  ``rows`` (a slice of the global batch) overrides the even process split: a process whose devices
  hold the batch replicated (e.g. tensor parallelism across processes) needs more than B/P rows."""
  T, B = cfg.seq_len, cfg.global_batch
  rng = np.random.default_rng([cfg.seed + seed_offset, step])
  offsets_B = rng.integers(0, data.size - T - 1, size=B)
  if rows is None:
    per = B // process_count
    rows = slice(process_index * per, (process_index + 1) * per)
  offsets = offsets_B[rows]
  win_BxT1 = data[offsets[:, None] + np.arange(T + 1)[None, :]].astype(np.int32)
  return {"inputs": win_BxT1[:, :-1], "targets": win_BxT1[:, 1:]}


class BatchIterator:
  """Checkpointable iterator: ``state()`` is {'step': int}; ``restore(state)`` jumps there."""

  def __init__(self, data: np.ndarray, cfg: DataConfig, step: int = 0, seed_offset: int = 0,
               process_index: int = 0, process_count: int = 1, rows: Optional[slice] = None):
    self.data, self.cfg, self.step = data, cfg, step
    self.seed_offset, self.pi, self.pc, self.rows = seed_offset, process_index, process_count, rows

  def __iter__(self) -> Iterator[dict]:
    return self

  def __next__(self) -> dict:
    b = batch_at(self.data, self.step, self.cfg, self.seed_offset, self.pi, self.pc, self.rows)
    self.step += 1
    return b

  def state(self) -> dict:
    return {"step": int(self.step), "seed": int(self.cfg.seed + self.seed_offset)}

  def restore(self, state: Optional[dict]) -> None:
    if state:
      if state.get("kind", "windows") != "windows":
        raise ConfigError(f"the checkpoint's data position is a {state['kind']} dataset's, not a text corpus's: "
                          "resume with the same data.corpus, or start a fresh workdir")
      if int(state.get("seed", self.cfg.seed + self.seed_offset)) != self.cfg.seed + self.seed_offset:
        raise ConfigError(f"checkpointed data seed {state['seed']} != data.seed {self.cfg.seed}: "
                          "resume with the same data.seed or start a fresh workdir")
      self.step = int(state["step"])
