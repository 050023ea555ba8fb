"""Data: deterministic batches, per-process sharding, checkpointable iterator (framework/data.py)."""
import numpy as np
import pytest

from framework import data as data_lib
from framework import tokenizer
from framework.config import ConfigError, DataConfig

CFG = DataConfig(seq_len=16, global_batch=8, max_bytes=200_000, seed=3)


@pytest.fixture(scope="module")
def corpus():
  return data_lib.load_corpus(CFG)


def test_stdlib_corpus_is_real_python_text(corpus):
  assert corpus.dtype == np.uint8 and corpus.size == CFG.max_bytes
  text = tokenizer.decode(corpus[:20_000])
  assert "# file: " in text and "def " in text and "import " in text
  # Deterministic: the same bytes on every call (sorted file order, fixed cap).
  np.testing.assert_array_equal(data_lib.load_corpus(CFG), corpus)


def test_batches_are_deterministic_and_shifted(corpus):
  a, b = data_lib.batch_at(corpus, 5, CFG), data_lib.batch_at(corpus, 5, CFG)
  for k in ("inputs", "targets"):
    assert a[k].shape == (8, 16) and a[k].dtype == np.int32
    np.testing.assert_array_equal(a[k], b[k])
  np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])  # next-byte prediction
  assert not np.array_equal(a["inputs"], data_lib.batch_at(corpus, 6, CFG)["inputs"])
  other_seed = DataConfig(seq_len=16, global_batch=8, max_bytes=200_000, seed=4)
  assert not np.array_equal(a["inputs"], data_lib.batch_at(corpus, 5, other_seed)["inputs"])
  assert not np.array_equal(a["inputs"], data_lib.batch_at(corpus, 5, CFG, seed_offset=1)["inputs"])


@pytest.mark.parametrize("n_proc", [2, 4, 8])
def test_process_shards_tile_the_global_batch(corpus, n_proc):
  full = data_lib.batch_at(corpus, 7, CFG)
  parts = [data_lib.batch_at(corpus, 7, CFG, process_index=i, process_count=n_proc) for i in range(n_proc)]
  for k in ("inputs", "targets"):
    assert all(p[k].shape == (8 // n_proc, 16) for p in parts)
    np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), full[k])


def test_iterator_state_restores_the_exact_position(corpus):
  it = data_lib.BatchIterator(corpus, CFG)
  for _ in range(3):
    next(it)
  state = it.state()
  assert state == {"step": 3, "seed": 3}
  expected = [next(it)["inputs"] for _ in range(2)]
  fresh = data_lib.BatchIterator(corpus, CFG)
  fresh.restore(state)
  for e in expected:
    np.testing.assert_array_equal(next(fresh)["inputs"], e)
  # Per-process iterators at the same state give this process's rows of the same global batch.
  p1 = data_lib.BatchIterator(corpus, CFG, process_index=1, process_count=2)
  p1.restore(state)
  np.testing.assert_array_equal(next(p1)["inputs"], expected[0][4:])
  with pytest.raises(ConfigError, match="same data.seed"):
    data_lib.BatchIterator(corpus, CFG).restore({"step": 1, "seed": 99})


def test_user_file_and_folder_corpora(tmp_path):
  (tmp_path / "a.txt").write_text("alpha " * 50)
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "b.md").write_text("beta " * 50)
  (tmp_path / "c.bin").write_bytes(b"\xff" * 500)  # extension not listed: skipped
  d = data_lib.load_corpus(DataConfig(corpus=str(tmp_path), seq_len=16))
  text = tokenizer.decode(d)
  assert "alpha" in text and "beta" in text and "\ufffd" not in text
  assert text.index("alpha") < text.index("beta")  # sorted file order
  single = data_lib.load_corpus(DataConfig(corpus=str(tmp_path / "a.txt"), seq_len=16))
  assert tokenizer.decode(single).endswith("alpha " * 50)


def test_eval_split_is_held_out(corpus):
  s = data_lib.split(corpus, CFG)
  assert s.train.size + s.eval.size == corpus.size and s.eval.size >= 2 * (CFG.seq_len + 1)
  np.testing.assert_array_equal(np.concatenate([s.train, s.eval]), corpus)


def test_tokenizer_round_trip():
  text = "def f(x):\n  return 'héllo' + \"🙂\"\n"
  ids = tokenizer.encode(text)
  assert ids.dtype == np.int32 and ids.max() < tokenizer.VOCAB_SIZE and len(ids) == len(text.encode())
  assert tokenizer.decode(ids) == text
