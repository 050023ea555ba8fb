"""Document datasets and tokenizers: jsonl / parquet streamed, BPE-tokenized, packed, resumed exactly
(framework/documents.py, framework/tokenizer.py, framework/data.py)."""
import json
import os
import pathlib
import subprocess
import sys
import zlib

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from framework import config as config_lib
from framework import data as data_lib
from framework import documents
from framework import tokenizer as tok_lib
from framework import train
from framework.config import ConfigError, DataConfig
from parallelism.step import build_on_devices
from tests.framework.tiny import tiny_config

REPO = str(pathlib.Path(__file__).resolve().parents[2])
WORDS = ("the model reads tokens and learns which word follows which one in a sentence about data "
         "packing windows resume exact checkpoint stream parquet json lines byte pair encoding").split()
EOS = "<|endoftext|>"
VOCAB = 256  # the BPE vocabulary trained below, at most; the tiny model's vocab_size


def _docs(n=160, seed=0):
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A byte-level BPE tokenizer trained here on the test documents (its alphabet: the bytes they use, so its
  vocabulary fits the tiny model's 256 rows and the runs below share the tiny config's compiled programs)."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False)
  tok.train_from_iterator(_docs() + ["\n# file: a.txt\n"], trainer)  # (the text corpus's file header too)
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  tok.save(str(path))
  return str(path)


def _write_jsonl(path, docs, key="text"):
  with open(path, "w") as f:
    for i, d in enumerate(docs):
      f.write(json.dumps({"id": i, key: d}) + "\n")
      if i % 17 == 5:
        f.write("\n")  # blank lines are skipped


def _write_parquet(path, docs, key="text", row_group=7):
  pq.write_table(pa.table({"id": list(range(len(docs))), key: docs}), str(path), row_group_size=row_group)


def _expected_stream(docs, tokenizer_json, eval_fraction):
  """The token stream the spec names, computed with the tokenizers library directly: each training document's
  ids, then EOS; documents whose CRC32 is in the lowest eval_fraction are held out."""
  tok = Tokenizer.from_file(tokenizer_json)
  eos = tok.token_to_id(EOS)
  out = []
  for d in docs:
    if d and zlib.crc32(d.encode()) >= eval_fraction * 2 ** 32:
      out += tok.encode(d, add_special_tokens=False).ids + [eos]
  return np.array(out)


def _cfg(corpus, **kw):
  return DataConfig(corpus=str(corpus), **kw)


def test_bpe_tokenizer_from_tokenizer_json(bpe, tmp_path):
  tok = tok_lib.load(bpe)
  ref = Tokenizer.from_file(bpe)
  assert tok.vocab_size == ref.get_vocab_size() and tok.eos_id == ref.token_to_id(EOS)
  text = "the model reads parquet."
  assert list(tok.encode(text)) == ref.encode(text).ids and tok.decode(tok.encode(text)) == text
  assert len(tok.encode(text)) < len(text.encode())  # merges learned: fewer tokens than bytes
  assert tok_lib.load(os.path.dirname(bpe)).vocab_size == tok.vocab_size  # a folder holding tokenizer.json
  tok_lib.check_vocab(tok, tok.vocab_size)
  assert 100 < tok.vocab_size <= VOCAB
  for bad, match in [(lambda: tok_lib.check_vocab(tok, 64), f"vocab_size={tok.vocab_size} or more"),
                     (lambda: tok_lib.load(str(tmp_path / "none.json")), "does not exist"),
                     (lambda: tok_lib.load(bpe, eos_token="<nope>"), "no token '<nope>'")]:
    with pytest.raises(ConfigError, match=match):
      bad()
  (tmp_path / "sp.model").write_bytes(b"\x00" * 10)
  (tmp_path / "bad.json").write_text("{not json")
  for path, match in [("sp.model", "is not a SentencePiece model"), ("bad.json", "not a tokenizer.json")]:
    with pytest.raises(ConfigError, match=match) as e:
      tok_lib.load(str(tmp_path / path))
    assert "\n" not in str(e.value) and "tokenizer.json" in str(e.value)


def test_sentencepiece_model(tmp_path):
  """A SentencePiece .model (trained here on the test documents) encodes as the library does, without BOS / EOS,
  decodes back, and ends documents with its own </s>."""
  import sentencepiece as spm
  (tmp_path / "docs.txt").write_text("\n".join(_docs()))
  spm.SentencePieceTrainer.Train(input=str(tmp_path / "docs.txt"), model_prefix=str(tmp_path / "sp"),
                                 vocab_size=48, model_type="unigram", minloglevel=2)
  tok = tok_lib.load(str(tmp_path / "sp.model"))
  ref = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
  text = "the model reads parquet windows."
  assert list(tok.encode(text)) == ref.encode(text) and tok.decode(tok.encode(text)) == text
  assert [list(x) for x in tok.encode_batch([text, "data packing."])] == [ref.encode(text), ref.encode("data packing.")]
  assert tok.vocab_size == 48 and tok.eos_id == ref.piece_to_id("</s>") != ref.unk_id()
  assert len(tok.encode(text)) < len(text.encode())
  with pytest.raises(ConfigError, match="has no token '<nope>'"):
    tok_lib.load(str(tmp_path / "sp.model"), eos_token="<nope>")


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_dataset_streams_documents_then_eos(bpe, tmp_path, kind):
  """Two files in a folder (sorted), blank jsonl lines / 7-row parquet row groups: the training stream is each
  non-held-out document's BPE ids + EOS, in order; held-out documents form the eval split."""
  docs = _docs()
  docs[10] = ""  # an empty document contributes nothing
  write = _write_jsonl if kind == "jsonl" else _write_parquet
  write(tmp_path / f"a.{kind}", docs[:90])
  write(tmp_path / f"b.{kind}", docs[90:])
  cfg = _cfg(tmp_path, seq_len=16, global_batch=4, eval_fraction=0.1, tokenizer=bpe)
  tok = tok_lib.load(bpe)
  assert documents.kind_of(tmp_path, "auto") == kind
  ds = documents.open_dataset(tmp_path, kind, cfg, tok)
  got = np.concatenate([ids for _, ids in ds.token_docs((0, 0, 0))])
  want = _expected_stream(docs, bpe, 0.1)
  np.testing.assert_array_equal(got, want)
  assert 0 < got.size < _expected_stream(docs, bpe, 0.0).size  # some documents held out, most not
  ev = documents.load_eval(ds, cfg)
  held = [d for d in docs if d and zlib.crc32(d.encode()) < 0.1 * 2 ** 32]
  assert ev.size == sum(len(tok.encode(d)) + 1 for d in held)
  # Restarting at a document's position yields the same documents from there on (the resume path).
  positions = [p for p, _ in ds.token_docs((0, 0, 0))]
  mid = positions[len(positions) // 2]
  tail = np.concatenate([ids for _, ids in ds.token_docs(mid)])
  np.testing.assert_array_equal(tail, got[got.size - tail.size:])


@pytest.mark.parametrize("shuffle", [0, 12])
def test_packing_is_exact_and_resumes_mid_block(bpe, tmp_path, shuffle):
  """Windows of seq_len+1 tokens concatenated reproduce the stream (over an epoch boundary), shuffled only within
  blocks; a restored iterator, per-process iterators and a fast-forwarded one give the same batches."""
  docs = _docs(40)
  _write_parquet(tmp_path / "d.parquet", docs)
  cfg = _cfg(tmp_path / "d.parquet", seq_len=8, global_batch=4, eval_fraction=0.0, tokenizer=bpe,
             shuffle_windows=shuffle)
  split = data_lib.load(tiny_config(data=dict(corpus=cfg.corpus, seq_len=8, global_batch=4, eval_fraction=0.0,
                                              tokenizer=bpe, shuffle_windows=shuffle),
                                    model=dict(vocab_size=VOCAB)))
  stream = _expected_stream(docs, bpe, 0.0)
  it = data_lib.iterator(split, cfg)
  assert isinstance(it, documents.PackedIterator) and it.K == (12 if shuffle else 4)
  n_steps = 2 * stream.size // (4 * 9) + 3  # past the end of the first epoch
  batches = [next(it) for _ in range(n_steps)]
  for b in batches:
    assert b["inputs"].shape == (4, 8) and b["inputs"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  win = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], 1) for b in batches])
  flat = np.tile(stream, 3)[:win.size].reshape(-1, 9)
  if not shuffle:
    np.testing.assert_array_equal(win, flat)  # packing is exact: no padding, no token lost or repeated
  else:
    blocks = win.shape[0] // 12 * 12
    for s in range(0, blocks, 12):  # each block is a permutation of the same 12 consecutive windows
      np.testing.assert_array_equal(np.sort(win[s:s + 12], axis=0), np.sort(flat[s:s + 12], axis=0))
    assert not np.array_equal(win[:blocks], flat[:blocks])
  # Resume from the state after 5 steps (mid-block when shuffling): the same next batches.
  it = data_lib.iterator(split, cfg)
  for _ in range(5):
    next(it)
  state = json.loads(json.dumps(it.state()))  # as the checkpoint stores it
  assert state["step"] == 5 and state["kind"] == "documents"
  fresh = data_lib.iterator(split, cfg)
  fresh.restore(state)
  for b in batches[5:9]:
    np.testing.assert_array_equal(next(fresh)["inputs"], b["inputs"])
  skipped = data_lib.iterator(split, cfg, step=5)  # no state: reads up to step 5
  np.testing.assert_array_equal(next(skipped)["inputs"], batches[5]["inputs"])
  p1 = data_lib.iterator(split, cfg, process_index=1, process_count=2)
  p1.restore(state)
  np.testing.assert_array_equal(next(p1)["inputs"], batches[5]["inputs"][2:])
  with pytest.raises(ConfigError, match="other files"):
    data_lib.iterator(split, cfg).restore(dict(state, data="0" * 16))
  with pytest.raises(ConfigError, match="text corpus"):
    data_lib.iterator(split, cfg).restore({"step": 3, "seed": 0})
  with pytest.raises(ConfigError, match="document"):
    data_lib.BatchIterator(np.zeros(100, np.uint8), cfg).restore(state)


def test_text_corpus_through_bpe_and_bytes_unchanged(bpe, tmp_path):
  """A text corpus keeps its random windows and max_bytes cap; with a tokenizer.json they are windows of its ids.
  With bytes (the default) data.load gives exactly the arrays it always gave."""
  (tmp_path / "a.txt").write_text("\n".join(_docs(60)))
  cfg = tiny_config(data=dict(corpus=str(tmp_path), seq_len=16, tokenizer=bpe, max_bytes=3000),
                    model=dict(vocab_size=VOCAB))
  s = data_lib.load(cfg)
  text = data_lib.load_corpus(cfg.data).tobytes().decode()
  assert len(text.encode()) == 3000
  assert s.train.dtype == np.uint16 and s.train.max() < VOCAB
  assert tok_lib.load(bpe).decode(np.concatenate([s.train, s.eval])) == text
  b = next(data_lib.iterator(s, cfg.data))
  assert b["inputs"].shape == (16, 16) and b["inputs"].max() < VOCAB
  default = tiny_config(data=dict(max_bytes=50_000))
  ref = data_lib.split(data_lib.load_corpus(default.data), default.data)
  got = data_lib.load(default)
  np.testing.assert_array_equal(got.train, ref.train)
  np.testing.assert_array_equal(got.eval, ref.eval)
  assert isinstance(got.tokenizer, tok_lib.Bytes) and got.train.dtype == np.uint8


def _one_line_error(cfg, match):
  with pytest.raises(ConfigError, match=match) as e:
    data_lib.load(cfg)
  assert "\n" not in str(e.value)


def test_bad_datasets_are_one_line_errors(bpe, tmp_path):
  good = dict(tokenizer=bpe, seq_len=8, global_batch=4)
  cfg = lambda corpus, **kw: tiny_config(data=dict(good, corpus=str(corpus), **kw), model=dict(vocab_size=VOCAB))  # noqa: E731
  _one_line_error(cfg(tmp_path / "missing.jsonl"), "does not exist")
  (tmp_path / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
  _one_line_error(cfg(tmp_path / "empty.jsonl"), "no training document")
  _write_jsonl(tmp_path / "k.jsonl", _docs(5), key="content")
  _one_line_error(cfg(tmp_path / "k.jsonl"), "no 'text' field: set --config.data.text_key")
  assert data_lib.load(cfg(tmp_path / "k.jsonl", text_key="content")).train.kind == "jsonl"
  (tmp_path / "p").mkdir()
  _write_parquet(tmp_path / "p" / "x.parquet", _docs(5), key="body")
  _one_line_error(cfg(tmp_path / "p"), r"no column 'text': set --config.data.text_key to one of \['id', 'body'\]")
  (tmp_path / "notes.txt").write_text("plain text\n" * 50)
  _one_line_error(cfg(tmp_path / "notes.txt", format="parquet"), "is not a parquet file")
  _one_line_error(cfg(tmp_path / "notes.txt", format="jsonl"), "is not JSON")
  (tmp_path / "p" / "y.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
  _one_line_error(cfg(tmp_path / "p"), "both .jsonl and .parquet")
  small = tiny_config(data=dict(good, corpus=str(tmp_path / "k.jsonl"), text_key="content"), model=dict(vocab_size=64))
  _one_line_error(small, "model.vocab_size=64 is smaller")
  _one_line_error(cfg(tmp_path / "k.jsonl", text_key="content", tokenizer="/no/tok.model"), "does not exist")
  with_eval = tiny_config(data=dict(good, corpus=str(tmp_path / "k.jsonl"), text_key="content", eval_fraction=0.01),
                          model=dict(vocab_size=VOCAB), train=dict(eval_every=2))
  _one_line_error(with_eval, "the eval split .* holds 0 tokens")  # 5 documents, none held out


def _train_cfg(corpus, bpe, **train_kw):
  return tiny_config(data=dict(corpus=str(corpus), tokenizer=bpe, shuffle_windows=48),
                     model=dict(vocab_size=VOCAB), checkpoint=dict(every=2, keep=3, async_save=True),
                     train=dict(steps=8, **train_kw))


def _losses(workdir) -> dict:
  """step -> every loss logged for it, in order (a resumed run logs its steps again)."""
  out = {}
  for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    if "loss" in r:
      out.setdefault(r["step"], []).append(r["loss"])
  return out


@pytest.fixture(scope="module")
def jsonl_run(bpe, tmp_path_factory):
  """A jsonl dataset and the uninterrupted 8-step run on it (the stream wraps into a second epoch)."""
  root = tmp_path_factory.mktemp("jsonl_run")
  _write_jsonl(root / "docs.jsonl", _docs())
  cfg = _train_cfg(root / "docs.jsonl", bpe)
  full = train.train_and_evaluate(cfg, str(root / "full"), build=build_on_devices)
  return root, cfg, full


def test_jsonl_bpe_run_stops_and_resumes_bit_identically(jsonl_run):
  root, cfg, full = jsonl_run
  part = train.train_and_evaluate(cfg, str(root / "split"), build=build_on_devices, max_steps=3)
  assert part["steps"] == 3
  resumed = train.train_and_evaluate(cfg, str(root / "split"), build=build_on_devices)
  lf, ls = _losses(root / "full"), _losses(root / "split")
  assert sorted(ls) == list(range(1, 9)) and all(len(v) == 1 for v in ls.values())  # resumed at step 3
  assert {s: v[0] for s, v in lf.items()} == {s: v[0] for s, v in ls.items()}, (lf, ls)
  assert lf[8][0] < lf[1][0] - 0.3  # it learns
  for x, y in zip(jax_leaves(full["state"].params), jax_leaves(resumed["state"].params)):
    np.testing.assert_array_equal(x, y)


def jax_leaves(tree):
  return jax.tree.leaves(jax.device_get(tree))


_KILLED = r"""
import json, os, signal, sys
from framework import config as config_lib, train
from parallelism.step import build_on_devices
workdir, cfg_json, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])

def build(cfg):
  obj = build_on_devices(cfg)
  real = obj.__class__.__call__

  class Killed(obj.__class__):
    def __call__(self, state, batch):
      if int(state.step) + 1 == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)  # no handler, no final save: as a crash or an OOM kill
      return real(self, state, batch)
  obj.__class__ = Killed
  return obj

train.train_and_evaluate(config_lib.from_dict(json.loads(cfg_json)), workdir, build=build)
"""


def test_parquet_bpe_run_killed_after_a_checkpoint_resumes_exactly(bpe, jsonl_run, tmp_path):
  """The issue's acceptance: a run on a parquet dataset with a BPE tokenizer, SIGKILLed in its own process while
  computing step 6 (after the saves of steps 2 and 4 started), resumes from its newest complete checkpoint; every
  step's loss equals the uninterrupted run's (the same documents in jsonl, so the same token stream)."""
  root, _, _ = jsonl_run
  docs = _docs()
  _write_parquet(tmp_path / "docs.parquet", docs)
  cfg = _train_cfg(tmp_path / "docs.parquet", bpe)
  wd = tmp_path / "killed"
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",  # the session's compilation cache (tiny.py)
             JAX_COMPILATION_CACHE_DIR=jax.config.values["jax_compilation_cache_dir"] or "",
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  proc = subprocess.run([sys.executable, "-c", _KILLED, str(wd), json.dumps(config_lib.to_dict(cfg)), "6"],
                        env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == -9, proc.stderr[-3000:]
  killed = _losses(wd)
  assert sorted(killed) == [1, 2, 3, 4, 5], killed
  train.train_and_evaluate(cfg, str(wd), build=build_on_devices)
  got, ref = _losses(wd), _losses(root / "full")
  assert sorted(got) == list(range(1, 9))
  resumed_from = min(s for s, v in got.items() if len(v) == 2) - 1
  assert resumed_from in (2, 4), got  # the newest complete checkpoint (4, or 2 if 4 was still being written)
  assert {s: v[-1] for s, v in got.items()} == {s: v[0] for s, v in ref.items()}, (got, ref)
  assert {s: v[0] for s, v in got.items()} == {s: v[0] for s, v in ref.items()}
