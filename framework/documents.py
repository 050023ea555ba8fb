"""Document datasets: local jsonl and parquet files, streamed, tokenized, packed into fixed windows.

A dataset is one ``.jsonl`` or ``.parquet`` file or a folder of them (sorted by path, searched recursively).
Each jsonl line is a JSON object whose ``data.text_key`` field is a document; each parquet row's
``text_key`` column is one. Files are read a line (jsonl) or a row group (parquet) at a time, never whole.

The token stream is the documents in order, each followed by the tokenizer's end-of-text token (EOS: GPT-2's
and Levanter's convention; the next document starts right after it), repeating epoch after epoch. The stream
is cut into consecutive windows of ``seq_len + 1`` tokens, so no token is padding; a window's first
``seq_len`` tokens are the inputs and its last ``seq_len`` the targets. Windows are shuffled in blocks of
``shuffle_windows`` (rounded up to a multiple of ``global_batch``): a block's windows are permuted by
``(data.seed, block number)`` and handed out ``global_batch`` at a time; every process builds the same block
and takes its own rows.

The iterator's state (saved in every checkpoint) is where the current block starts in the stream (epoch, file,
line byte offset / row group, row, token offset in that document), the block's number and the windows of it
already handed out; a resume reads that block again and continues with exactly the same tokens.

Held out for evaluation: the documents whose CRC32 lies in the lowest ``eval_fraction`` of its range (a split
that needs no count of the documents and no fixed order); they never enter the training stream.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import zlib
from typing import Iterator, List, Optional, Tuple

import numpy as np

from framework.config import ConfigError, DataConfig

SUFFIXES = {"jsonl": (".jsonl",), "parquet": (".parquet",)}
TOKENIZE_BATCH = 256  # documents tokenized together (the tokenizers library runs a batch on all cores)
EVAL_TOKEN_CAP = 1 << 20  # the eval split holds at most this many tokens


def kind_of(root: pathlib.Path, fmt: str) -> str:
  """'jsonl', 'parquet' or 'text' for ``data.corpus`` at ``root`` under ``data.format=fmt``."""
  if fmt != "auto":
    return fmt
  if root.is_file():
    return next((k for k, sfx in SUFFIXES.items() if root.suffix in sfx), "text")
  found = {k for k, sfx in SUFFIXES.items() if root.is_dir() and any(root.rglob(f"*{sfx[0]}"))}
  if len(found) > 1:
    raise ConfigError(f"data.corpus={str(root)!r} holds both .jsonl and .parquet files: set "
                      f"--config.data.format=jsonl or parquet")
  return found.pop() if found else "text"


@dataclasses.dataclass
class Dataset:
  """The files of a document dataset and how to read them; ``eval`` is the held-out token array."""
  files: List[pathlib.Path]
  kind: str
  text_key: str
  tok: object
  eval_fraction: float
  fingerprint: str
  eval: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))

  def is_eval(self, text: str) -> bool:
    return zlib.crc32(text.encode("utf-8")) < self.eval_fraction * 2 ** 32

  def rows(self, pos: Tuple[int, int, int]) -> Iterator[Tuple[Tuple[int, int, int], str]]:
    """(position, text) of every document from ``pos`` = (file, unit, row) to the end of the dataset.
    jsonl: unit = the line's byte offset, row = its line number; parquet: unit = row group, row = its row."""
    f0, u0, r0 = pos
    for fi in range(f0, len(self.files)):
      start = (u0, r0) if fi == f0 else (0, 0)
      read = _jsonl_rows if self.kind == "jsonl" else _parquet_rows
      for (u, r), text in read(self.files[fi], self.text_key, *start):
        yield (fi, u, r), text

  def token_docs(self, pos) -> Iterator[Tuple[Tuple[int, int, int], np.ndarray]]:
    """(position, ids + EOS) of every training document from ``pos`` on (tokenized in batches)."""
    buf = []
    for p, text in self.rows(pos):
      if not text or self.is_eval(text):
        continue
      buf.append((p, text))
      if len(buf) == TOKENIZE_BATCH:
        yield from self._encode(buf)
        buf = []
    yield from self._encode(buf)

  def _encode(self, buf):
    eos = np.array([self.tok.eos_id], np.int32)
    for (p, _), ids in zip(buf, self.tok.encode_batch([t for _, t in buf])):
      yield p, np.concatenate([ids, eos])


def _where(path, line):
  return f"{path} line {line + 1}"


def _jsonl_rows(path: pathlib.Path, key: str, offset: int, line: int):
  with open(path, "rb") as f:
    f.seek(offset)
    for raw in f:
      at, offset = offset, offset + len(raw)
      if raw.strip():
        yield (at, line), _jsonl_text(raw, key, path, line)
      line += 1


def _jsonl_text(raw: bytes, key: str, path, line: int) -> str:
  try:
    row = json.loads(raw)
  except ValueError as e:
    raise ConfigError(f"{_where(path, line)} is not JSON ({e}): data.corpus must hold one JSON object per line "
                      f"(or set --config.data.format=text to train on the raw file)") from None
  if not isinstance(row, dict) or key not in row:
    raise ConfigError(f"{_where(path, line)} has no {key!r} field: set --config.data.text_key to the field that "
                      f"holds the text" + (f" (this row has {sorted(row)[:8]})" if isinstance(row, dict) else ""))
  text = row[key]
  if text is not None and not isinstance(text, str):
    raise ConfigError(f"{_where(path, line)}: field {key!r} is {type(text).__name__}, not a string: set "
                      f"--config.data.text_key to the field that holds the text")
  return text or ""


def _parquet_file(path: pathlib.Path, key: str):
  import pyarrow as pa  # noqa: PLC0415 (heavy: pyarrow loads in ~0.5 s; only parquet datasets need it)
  import pyarrow.parquet as pq  # noqa: PLC0415 (heavy: pyarrow; only parquet datasets need it)
  try:
    pf = pq.ParquetFile(path)
  except (pa.ArrowException, OSError) as e:
    raise ConfigError(f"{path} is not a parquet file ({str(e).splitlines()[0]}): pass .parquet files, or set "
                      f"--config.data.format to what it holds") from None
  names = pf.schema_arrow.names
  if key not in names:
    raise ConfigError(f"{path} has no column {key!r}: set --config.data.text_key to one of {names[:12]}")
  if not (pa.types.is_string(pf.schema_arrow.field(key).type) or pa.types.is_large_string(
      pf.schema_arrow.field(key).type)):
    raise ConfigError(f"{path}: column {key!r} is {pf.schema_arrow.field(key).type}, not a string: set "
                      f"--config.data.text_key to the column that holds the text")
  return pf


def _parquet_rows(path: pathlib.Path, key: str, group: int, row: int):
  pf = _parquet_file(path, key)
  for g in range(group, pf.num_row_groups):
    texts = pf.read_row_group(g, columns=[key]).column(key).to_pylist()  # one row group in memory
    for r in range(row if g == group else 0, len(texts)):
      yield (g, r), texts[r] or ""


def open_dataset(root: pathlib.Path, kind: str, cfg: DataConfig, tok) -> Dataset:
  """Lists and checks the files (first row / schema of each) and that there is a training document."""
  spec = cfg.corpus
  if root.is_file():
    files = [root]
  else:
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in SUFFIXES[kind])
    if not files:
      raise ConfigError(f"data.corpus={spec!r}: no {'/'.join(SUFFIXES[kind])} files under {root}")
  for f in files:
    if kind == "parquet":
      _parquet_file(f, cfg.text_key)
    else:
      with open(f, "rb") as fh:
        first = next(((i, line) for i, line in enumerate(fh) if line.strip()), None)
      if first is not None:
        _jsonl_text(first[1], cfg.text_key, f, first[0])
  base = root if root.is_dir() else root.parent
  h = hashlib.sha1(json.dumps([kind, cfg.text_key, tok.fingerprint, cfg.eval_fraction] + [
      [str(f.relative_to(base)), f.stat().st_size] for f in files]).encode()).hexdigest()[:16]
  ds = Dataset(files, kind, cfg.text_key, tok, cfg.eval_fraction, h)
  if next(ds.token_docs((0, 0, 0)), None) is None:
    raise ConfigError(f"data.corpus={spec!r} has no training document (no non-empty {cfg.text_key!r} outside the "
                      f"eval split): pass a dataset with text, or lower data.eval_fraction")
  return ds


def load_eval(ds: Dataset, cfg: DataConfig) -> np.ndarray:
  """The held-out documents' tokens (each + EOS), from the start of the dataset, at most EVAL_TOKEN_CAP."""
  cap = max(min(16 * cfg.global_batch * (cfg.seq_len + 1), EVAL_TOKEN_CAP), 2 * (cfg.seq_len + 1))
  parts, n = [], 0
  for _, text in ds.rows((0, 0, 0)):
    if text and ds.is_eval(text):
      parts.append(np.append(ds.tok.encode(text), np.int32(ds.tok.eos_id)).astype(np.int32))
      n += parts[-1].size
      if n >= cap:
        break
  ev = np.concatenate(parts)[:cap] if parts else np.zeros(0, np.int32)
  if ev.size < 2 * (cfg.seq_len + 1):
    raise ConfigError(f"data.corpus={cfg.corpus!r}: the eval split (data.eval_fraction={cfg.eval_fraction}) holds "
                      f"{ev.size} tokens, too few for 2 windows of seq_len+1={cfg.seq_len + 1}: raise "
                      f"data.eval_fraction, or set train.eval_every=0")
  return ev


class PackedIterator:
  """Checkpointable iterator over packed windows of a :class:`Dataset` (module docstring): this process's
  ``rows`` of each global batch, {'inputs', 'targets'} int32 BxT."""

  def __init__(self, ds: Dataset, cfg: DataConfig, step: int = 0, seed_offset: int = 0,
               process_index: int = 0, process_count: int = 1, rows: Optional[slice] = None):
    B = cfg.global_batch
    self.ds, self.cfg, self.W = ds, cfg, cfg.seq_len + 1
    self.K = max(math.ceil(cfg.shuffle_windows / B), 1) * B  # windows per block
    self.seed = cfg.seed + seed_offset
    if rows is None:
      per = B // process_count
      rows = slice(process_index * per, (process_index + 1) * per)
    self.rows = rows
    self.step, self.block, self.window = 0, 0, 0
    self.start = (0, 0, 0, 0, 0)  # the block's first token: epoch, file, unit, row, token offset
    self.windows_KxW, self.end, self._docs, self._at, self._pending = None, None, None, None, None
    self._to_skip = step  # without a restored state, the first batch is global batch `step`

  def __iter__(self):
    return self

  def _stream(self, start):
    """(epoch, position, ids + EOS, first token) of the training documents from ``start`` on, endlessly; the
    first document is read from ``start``'s token offset, every later one from 0."""
    epoch, f, u, r, off = start
    pos = (f, u, r)
    while True:
      for p, ids in self.ds.token_docs(pos):
        yield epoch, p, ids, off
        off = 0
      epoch, pos = epoch + 1, (0, 0, 0)

  def _fill(self):
    """Reads the block that starts at ``self.start``; sets ``self.end`` (where the next one starts)."""
    if self._at != self.start:
      self._docs, self._pending = self._stream(self.start), None
    need, parts, got = self.K * self.W, [], 0
    while got < need:
      epoch, p, ids, off = self._pending or next(self._docs)
      take = min(ids.size - off, need - got)
      parts.append(ids[off:off + take])
      got += take
      self._pending = (epoch, p, ids, off + take) if off + take < ids.size else None
    if self._pending is None:  # the block ended with a document: the next one starts the next block
      self._pending = next(self._docs)
    epoch, p, _, off = self._pending
    self.end = (epoch, *p, off)
    self._at = self.end
    order = np.random.default_rng([self.seed, self.block]).permutation(self.K) if self.cfg.shuffle_windows \
        else np.arange(self.K)
    self.windows_KxW = np.concatenate(parts).reshape(self.K, self.W)[order]

  def _next_global(self) -> np.ndarray:
    if self.windows_KxW is None:
      self._fill()
    B = self.cfg.global_batch
    out_BxW = self.windows_KxW[self.window:self.window + B]
    self.window += B
    self.step += 1
    if self.window == self.K:
      self.block, self.window, self.start, self.windows_KxW = self.block + 1, 0, self.end, None
    return out_BxW

  def _catch_up(self) -> None:
    while self._to_skip:  # a run that starts past step 0 without a data state: read up to that step
      self._to_skip -= 1
      self._next_global()

  def __next__(self) -> dict:
    self._catch_up()
    win_BxW = self._next_global()[self.rows].astype(np.int32)
    return {"inputs": win_BxW[:, :-1], "targets": win_BxW[:, 1:]}

  def state(self) -> dict:
    self._catch_up()
    return {"kind": "documents", "step": int(self.step), "seed": int(self.seed), "data": self.ds.fingerprint,
            "block": int(self.block), "window": int(self.window), "start": [int(x) for x in self.start]}

  def restore(self, state: Optional[dict]) -> None:
    if not state:
      return
    if state.get("kind") != "documents":
      raise ConfigError("the checkpoint's data position is a text corpus's, not a document dataset's: resume with "
                        "the same data.corpus, or start a fresh workdir")
    if int(state["seed"]) != self.seed:
      raise ConfigError(f"checkpointed data seed {state['seed']} != data.seed {self.cfg.seed}: resume with the "
                        "same data.seed or start a fresh workdir")
    if state["data"] != self.ds.fingerprint:
      raise ConfigError("the checkpoint was trained on other files, text_key, tokenizer or eval_fraction than "
                        "this config's data: resume with the same data settings or start a fresh workdir")
    self.step, self.block, self.window = int(state["step"]), int(state["block"]), int(state["window"])
    self._to_skip = 0
    self.start, self.windows_KxW = tuple(int(x) for x in state["start"]), None
