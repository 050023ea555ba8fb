"""Chat prompts from a GGUF file's own template (``tokenizer.chat_template``, Jinja).

Rendered the way llama-cpp-python renders it for ``create_chat_completion`` (and Hugging Face transformers for
``apply_chat_template``): a sandboxed jinja2 environment with trim_blocks and lstrip_blocks, the loop-control
extension, ``messages``, ``bos_token``, ``eos_token``, ``add_generation_prompt`` and ``raise_exception``. The
prompt is then tokenized with special tokens parsed, and BOS added only when the template did not write it.
A file without a template gets a plain "role: content" transcript (and says so in ``Chat.source``).
"""
from __future__ import annotations

import json
from typing import Optional

from ondevice.vocab import Vocab

PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant:{% endif %}")
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
  """Messages or a template that cannot be rendered; the message says what to fix."""


def _env():
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                     extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
  return env


def check_messages(messages) -> list:
  """OpenAI-style messages -> [{'role', 'content'}] with string contents (text parts joined), or ChatError."""
  if not isinstance(messages, list) or not messages:
    raise ChatError("'messages' must be a non-empty list of {role, content} objects")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise ChatError(f"messages[{i}] needs a 'role' of {', '.join(ROLES)}")
    c = m.get("content", "")
    if isinstance(c, list):  # [{"type": "text", "text": ...}, ...]
      if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
        raise ChatError(f"messages[{i}].content: only text parts are supported")
      c = "".join(p["text"] for p in c)
    if c is None:
      c = ""
    if not isinstance(c, str):
      raise ChatError(f"messages[{i}].content must be a string or a list of text parts")
    out.append({"role": m["role"], "content": c})
  return out


class Chat:
  """The chat template of a vocabulary: ``prompt(messages) -> text``, ``tokens(messages) -> ids``."""

  def __init__(self, vocab: Vocab, template: Optional[str] = None):
    self.vocab = vocab
    self.source = "argument" if template else "tokenizer.chat_template" if vocab.chat_template else "plain"
    self.text = template or vocab.chat_template or PLAIN
    try:
      self.template = _env().from_string(self.text)
    except Exception as e:  # noqa: BLE001 - jinja2.TemplateSyntaxError and friends
      raise ChatError(f"the chat template does not parse ({type(e).__name__}: {e}); pass another one") from None

  def _special(self, i: Optional[int]) -> str:
    return self.vocab.tokens[i] if i is not None else ""

  def prompt(self, messages, add_generation_prompt: bool = True) -> str:
    def raise_exception(msg):
      raise ChatError(f"the chat template refused the messages: {msg}")
    try:
      return self.template.render(messages=check_messages(messages), add_generation_prompt=add_generation_prompt,
                                  bos_token=self._special(self.vocab.bos_id),
                                  eos_token=self._special(self.vocab.eos_id), raise_exception=raise_exception)
    except ChatError:
      raise
    except Exception as e:  # noqa: BLE001 - a template error on these messages
      raise ChatError(f"the chat template failed on these messages ({type(e).__name__}: {e})") from None

  def tokens(self, messages) -> list:
    text = self.prompt(messages)
    bos = self._special(self.vocab.bos_id)
    return self.vocab.encode(text, add_special=not (bos and text.startswith(bos)), parse_special=True)
