"""One run per workdir (framework/workdir.py): a live holder refuses the next run at once, naming it; a stale
holder line is taken over; a workdir that is a file is refused; a non-text corpus is refused by name
(framework/data.py)."""
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from framework import data as data_lib
from framework import workdir as workdir_lib
from framework.config import ConfigError, DataConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def hold_lock(workdir: str, what: str = "training run"):
  """Another process that holds the workdir lock until the block ends (yields its Popen)."""
  code = ("import sys, time; from framework import workdir; workdir.lock(sys.argv[1], sys.argv[2]); "
          "print('locked', flush=True); time.sleep(600)")
  p = subprocess.Popen([sys.executable, "-c", code, workdir, what], cwd=REPO, stdout=subprocess.PIPE, text=True,
                       env=dict(os.environ, PYTHONPATH=REPO))
  try:
    assert p.stdout.readline().strip() == "locked"
    yield p
  finally:
    p.kill()
    p.wait()


def test_live_holder_refuses_at_once_and_names_itself(tmp_path):
  wd = str(tmp_path / "wd")
  with hold_lock(wd) as holder:
    t0 = time.time()
    with pytest.raises(workdir_lib.WorkdirError) as e:
      workdir_lib.lock(wd, "training run")
    assert time.time() - t0 < 2
    msg = str(e.value)
    assert f"pid {holder.pid} on host {socket.gethostname()}" in msg and "use another --workdir" in msg
    assert "\n" not in msg
  lock = workdir_lib.lock(wd)  # the kernel freed it when the holder died (its line is stale: taken over)
  lock.release()
  assert open(os.path.join(wd, workdir_lib.LOCK_NAME)).read() == ""  # a clean release leaves no holder line


def test_stale_lock_is_taken_over_with_a_message(tmp_path, caplog):
  wd = tmp_path / "wd"
  wd.mkdir()
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()  # a pid that no longer runs on this host
  (wd / workdir_lib.LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                        "since": "x"}) + "\n")
  with caplog.at_level(logging.WARNING, logger="prismllm"):
    lock = workdir_lib.lock(str(wd))
  try:
    assert any(f"took over the stale lock of pid {dead.pid}" in r.getMessage() for r in caplog.records)
    holder = json.loads((wd / workdir_lib.LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    again = workdir_lib.lock(str(wd))  # the same process locking again (entry point, then the loop): one lock
    assert again is lock
    again.release()
    assert lock.fd is not None  # still held by the first holder
  finally:
    lock.release()
  assert lock.fd is None


def test_workdir_that_is_a_file_is_refused(tmp_path):
  f = tmp_path / "wd"
  f.write_text("not a folder")
  with pytest.raises(workdir_lib.WorkdirError, match="is a file, not a folder: pass a folder path"):
    workdir_lib.check_path(str(f))
  with pytest.raises(workdir_lib.WorkdirError, match="its parent"):
    workdir_lib.lock(str(f / "sub"))
  assert f.read_text() == "not a folder"


def test_binary_corpus_is_refused_by_name(tmp_path):
  text = tmp_path / "t.txt"
  text.write_bytes(("héllo wörld, plain text\n" * 200).encode() + "Grüße\n".encode("latin-1"))  # one stray latin-1
  assert data_lib.load_corpus(DataConfig(corpus=str(text), seq_len=8)).size > 0
  for name, raw in [("ls", open(sys.executable, "rb").read(200_000)),
                    ("nul.txt", b"text\x00" * 2000),
                    ("bad_utf8.txt", bytes(range(128, 256)) * 100)]:
    p = tmp_path / name
    p.write_bytes(raw)
    with pytest.raises(ConfigError, match=f"{p} is not text .*pass a text file or folder"):
      data_lib.load_corpus(DataConfig(corpus=str(p), seq_len=8))
  folder = tmp_path / "folder"
  folder.mkdir()
  (folder / "a.py").write_text("def f():\n  return 1\n" * 50)
  (folder / "b.py").write_bytes(b"\x00\x01\x02" * 300)
  with pytest.raises(ConfigError, match=r"b\.py is not text"):
    data_lib.load_corpus(DataConfig(corpus=str(folder), seq_len=8))
