"""ondevice.serve on loopback with the ``openai`` client: streamed and plain chat completions, completions equal
to llama.cpp's greedy text, sampling with a seed. (Bad requests, 100 concurrent ones, the CLI's errors: the
``serve`` fault cases, tests/ondevice/test_faults.py.)"""
import threading

import numpy as np
import pytest

from benchmarks.reliability import ondevice_area, serve_cases
from ondevice import serve

from .conftest import llama_cpp_peer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
  ws = ondevice_area.Workspace(str(tmp_path_factory.mktemp("serve")))
  path = serve_cases.chat_model(ws)
  srv, svc = serve.serve(path, "127.0.0.1", 0, ctx=256, name="tiny")
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", api_key="unused", max_retries=0)
  yield client, svc, path
  srv.shutdown()
  srv.server_close()
  svc.close()


def test_models_and_streamed_chat(server):
  client, svc, _ = server
  assert [m.id for m in client.models.list()] == ["tiny"]
  msgs = [{"role": "system", "content": "terse"}, {"role": "user", "content": "def f(x):"}]
  full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
  text = full.choices[0].message.content
  assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason in ("length", "stop")
  assert full.usage.prompt_tokens == len(svc.chat.tokens(msgs)) and full.usage.completion_tokens >= 1
  chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0,
                                               stream=True))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text and len(chunks) > 3
  assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_completion_equals_llama_cpp_greedy(server):
  client, svc, path = server
  llm = llama_cpp_peer().Llama(path, n_ctx=256, n_threads=1, type_k=0, type_v=0, flash_attn=False, verbose=False)
  prompt = "import os\nclass A:\n  "
  ids = llm.tokenize(prompt.encode(), add_bos=True)
  assert ids == svc.vocab.encode(prompt)
  theirs = []
  for t in llm.generate(ids, temp=0.0):
    if t == llm.token_eos() or len(theirs) == 20:
      break
    theirs.append(t)
  r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
  assert r.choices[0].text == svc.vocab.decode(theirs) and r.usage.completion_tokens == len(theirs)


def test_sampling_is_seeded_and_stop_strings_cut(server):
  client, _, _ = server
  ask = dict(model="tiny", prompt="def ", max_tokens=24, temperature=1.5, top_p=1.0,
             extra_body={"top_k": 0, "min_p": 0.0})  # llama.cpp-style extras, as its server takes them
  a = client.completions.create(seed=7, **ask).choices[0].text
  b = client.completions.create(seed=7, **ask).choices[0].text
  others = {client.completions.create(seed=s, **ask).choices[0].text for s in (8, 9, 10)}
  assert a == b and len(others - {a}) >= 2  # the same seed repeats; other seeds give other texts
  greedy = client.completions.create(model="tiny", prompt="def ", max_tokens=24, temperature=0).choices[0].text
  k1 = client.completions.create(model="tiny", prompt="def ", max_tokens=24, temperature=1.0, seed=3,
                                 extra_body={"top_k": 1}).choices[0].text
  assert k1 == greedy  # top-k 1 leaves the argmax only
  stop = greedy[5:7]
  if stop and stop in greedy:
    r = client.completions.create(model="tiny", prompt="def ", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == greedy[:greedy.index(stop)] and r.choices[0].finish_reason == "stop"


def test_sampler_distribution_follows_temperature():
  """The sampler alone: at temperature T the token frequencies follow softmax(logits / T) (top-k/p/min-p off)."""
  from ondevice.sampling import Sampler, SamplingParams
  logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
  s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0))
  counts = np.bincount([s.pick(logits) for _ in range(4000)], minlength=4) / 4000
  assert np.abs(counts - [0.5, 0.3, 0.15, 0.05]).max() < 0.03, counts
  s = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=0))
  assert set(s.pick(logits) for _ in range(200)) == {0, 1}
  s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=100.0, seed=0))
  assert all(s.pick(logits, history=[0]) != 0 for _ in range(50))  # a repeated token is penalised away
