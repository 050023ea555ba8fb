"""A GGUF file's own tokenizer: its ``tokenizer.ggml.*`` metadata, and text <-> ids as llama.cpp computes them.

``Vocab`` holds the metadata (read from a file, built from a Hugging Face ``tokenizer.json`` (``hf_vocab``), or the
byte vocabulary of ondevice/tokenizer.py) and writes it to a GGUF writer. ``Vocab.encode`` follows llama.cpp's
llama-vocab.cpp:
* special tokens (CONTROL / USER_DEFINED / UNKNOWN types, longest first) are cut out of the text first when
  ``parse_special`` (USER_DEFINED always);
* SPM (``tokenizer.ggml.model`` = llama): spaces -> U+2581 (a leading one when add_space_prefix), then bigram
  merges of UTF-8 characters by token score (highest first, leftmost on ties), undone where the result is not a
  token, and bytes of what is left as <0xXX> tokens;
* BPE (gpt2): the pre-tokenizer's regexes (``tokenizer.ggml.pre``: default, gpt-2, llama-bpe, qwen2) split the
  text, every piece's bytes become GPT-2's byte-level characters, merges apply by rank (lowest first, leftmost
  on ties); llama-bpe first looks the whole piece up (ignore_merges).
``decode``/``piece`` render tokens as llama.cpp's token_to_piece does (control tokens as nothing).
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Optional

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# tokenizer.ggml.pre -> (regexes applied in turn, ignore_merges, add_bos default)
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
           r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?"
          r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE = {
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False, False),
    "gpt-2": ((_GPT2,), False, False),
    "llama-bpe": ((_LLAMA3,), True, True), "llama3": ((_LLAMA3,), True, True), "llama-v3": ((_LLAMA3,), True, True),
    "qwen2": ((_QWEN2,), False, False),
}
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
             "<|end_of_text|>")


class VocabError(ValueError):
  """A tokenizer this runtime cannot reproduce; the message names the key and what to do."""


@functools.lru_cache(maxsize=1)
def _byte_maps() -> tuple:
  """GPT-2's bytes <-> printable characters (byte-level BPE)."""
  bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  enc = {b: chr(c) for b, c in zip(bs, cs)}
  return enc, {v: k for k, v in enc.items()}


@dataclasses.dataclass
class Vocab:
  model: str  # "llama" (SPM) or "gpt2" (byte-level BPE)
  tokens: list
  types: list
  scores: Optional[list] = None
  merges: Optional[list] = None
  pre: Optional[str] = None
  bos_id: Optional[int] = None
  eos_id: Optional[int] = None
  unk_id: Optional[int] = None
  pad_id: Optional[int] = None
  eot_id: Optional[int] = None
  add_bos: Optional[bool] = None  # None: llama.cpp's default for the model / pre-tokenizer
  add_eos: bool = False
  add_space_prefix: Optional[bool] = None
  chat_template: Optional[str] = None
  extra: dict = dataclasses.field(default_factory=dict)  # more string keys to write (prismllm.tokenizer)

  def __post_init__(self):
    if self.model not in ("llama", "gpt2"):
      raise VocabError(f"tokenizer.ggml.model={self.model!r}: this runtime tokenizes 'llama' (SPM) and 'gpt2' "
                       f"(BPE) vocabularies; pass token ids (--prompt-ids) or run it with llama.cpp")
    if self.model == "gpt2" and (self.pre or "default") not in PRE:
      raise VocabError(f"tokenizer.ggml.pre={self.pre!r} is not one of the pre-tokenizers implemented here "
                       f"({', '.join(PRE)}); pass token ids (--prompt-ids) or run it with llama.cpp")
    self.ids = {t: i for i, t in enumerate(self.tokens)}
    self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(self.merges or ())}
    spm = self.model == "llama"
    regexes, self.ignore_merges, bos_default = PRE.get(self.pre or "default", ((), False, False))
    import regex
    self._regexes = [regex.compile(r) for r in regexes] if not spm else []
    self.add_bos_ = self.add_bos if self.add_bos is not None else (True if spm else bos_default)
    self.space_prefix = self.add_space_prefix if self.add_space_prefix is not None else spm
    self.special = sorted((i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED, UNKNOWN)),
                          key=lambda i: -len(self.tokens[i].encode()))
    eog = {i for i in (self.eos_id, self.eot_id) if i is not None}
    eog |= {self.ids[t] for t in EOG_TEXTS if t in self.ids}
    self.eog = frozenset(eog)
    self._cache: dict = {}

  # ------------------------------------------------------------------ GGUF
  def write(self, w) -> None:
    """Adds the tokenizer.ggml.* keys to a gguf.GGUFWriter."""
    w.add_tokenizer_model(self.model)
    if self.pre:
      w.add_tokenizer_pre(self.pre)
    w.add_token_list(self.tokens)
    if self.scores is not None:
      w.add_token_scores(self.scores)
    w.add_token_types(self.types)
    if self.merges:
      w.add_token_merges(self.merges)
    for key, v in (("bos", self.bos_id), ("eos", self.eos_id), ("unk", self.unk_id), ("pad", self.pad_id),
                   ("eot", self.eot_id)):
      if v is not None:
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", int(v))
    if self.add_bos is not None:
      w.add_add_bos_token(bool(self.add_bos))
    w.add_add_eos_token(bool(self.add_eos))
    if self.add_space_prefix is not None:
      w.add_add_space_prefix(bool(self.add_space_prefix))
    if self.chat_template:
      w.add_chat_template(self.chat_template)
    for k, v in self.extra.items():
      w.add_string(k, v)

  # ------------------------------------------------------------------ text -> ids
  def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list:
    """llama_tokenize(text, add_special, parse_special)."""
    out = []
    if add_special and self.add_bos_ and self.bos_id is not None:
      out.append(self.bos_id)
    prev_special = True
    for frag in self._partition(text, parse_special):
      if isinstance(frag, int):
        out.append(frag)
        prev_special = True
        continue
      if self.model == "llama":
        out += self._spm((" " if self.space_prefix and prev_special else "") + frag)
      else:
        out += self._bpe(frag)
      prev_special = False
    if add_special and self.add_eos and self.eos_id is not None:
      out.append(self.eos_id)
    return out

  def _partition(self, text: str, parse_special: bool) -> list:
    frags: list = [text] if text else []
    for sid in self.special:
      if not parse_special and self.types[sid] in (CONTROL, UNKNOWN):
        continue
      tok = self.tokens[sid]
      if not tok:
        continue
      nxt = []
      for f in frags:
        if isinstance(f, int) or tok not in f:
          nxt.append(f)
          continue
        parts = f.split(tok)
        for j, p in enumerate(parts):
          if p:
            nxt.append(p)
          if j < len(parts) - 1:
            nxt.append(sid)
      frags = nxt
    return frags

  def _byte_token(self, b: int) -> int:
    if self.model == "llama":
      i = self.ids.get(f"<0x{b:02X}>")
    else:
      i = self.ids.get(_byte_maps()[0][b])
    if i is None:
      raise VocabError(f"byte 0x{b:02X} has no token in this vocabulary; pass token ids (--prompt-ids)")
    return i

  def _spm(self, text: str) -> list:
    """llm_tokenizer_spm_session: every merge makes a token, so a final symbol is a token or a single character
    that is not one (then its UTF-8 bytes)."""
    syms = list(text.replace(" ", SPACE))
    n = len(syms)
    nxt, prv, alive = list(range(1, n)) + [-1], list(range(-1, n - 1)), [True] * n
    heap: list = []

    def add(left, right):
      if left < 0 or right < 0:
        return
      s = syms[left] + syms[right]
      i = self.ids.get(s)
      if i is not None:
        heapq.heappush(heap, (-(self.scores[i] if self.scores else 0.0), left, right, len(s.encode())))

    for i in range(1, n):
      add(i - 1, i)
    while heap:
      _, left, right, size = heapq.heappop(heap)
      if not alive[left] or not alive[right] or len((syms[left] + syms[right]).encode()) != size:
        continue
      syms[left] += syms[right]
      alive[right] = False
      nxt[left] = nxt[right]
      if nxt[right] >= 0:
        prv[nxt[right]] = left
      add(prv[left], left)
      add(left, nxt[left])
    out: list = []
    i = 0 if n else -1
    while i >= 0:
      t = self.ids.get(syms[i])
      out += [t] if t is not None else [self._byte_token(b) for b in syms[i].encode()]
      i = nxt[i]
    return out

  def _bpe(self, text: str) -> list:
    words = [text]
    for rx in self._regexes:
      nw = []
      for w in words:
        pos = 0
        for m in rx.finditer(w):
          if m.start() > pos:
            nw.append(w[pos:m.start()])
          if m.end() > m.start():
            nw.append(m.group())
          pos = m.end()
        if pos < len(w):
          nw.append(w[pos:])
      words = nw
    enc = _byte_maps()[0]
    out: list = []
    for w in words:
      wb = "".join(enc[b] for b in w.encode())
      got = self._cache.get(wb)
      if got is None:
        got = self._cache[wb] = self._bpe_word(wb)
      out += got
    return out

  def _bpe_word(self, w: str) -> list:
    if self.ignore_merges and w in self.ids:
      return [self.ids[w]]
    syms = list(w)
    n = len(syms)
    nxt, prv, alive = list(range(1, n)) + [-1], list(range(-1, n - 1)), [True] * n
    heap = []

    def add(left, right):
      if left < 0 or right < 0:
        return
      r = self.ranks.get((syms[left], syms[right]))
      if r is not None:
        heapq.heappush(heap, (r, left, syms[left] + syms[right]))

    for i in range(1, n):
      add(i - 1, i)
    while heap:
      _, left, text = heapq.heappop(heap)
      right = nxt[left]
      if not alive[left] or right < 0 or syms[left] + syms[right] != text:
        continue
      syms[left] = text
      alive[right] = False
      nxt[left] = nxt[right]
      if nxt[right] >= 0:
        prv[nxt[right]] = left
      add(prv[left], left)
      add(left, nxt[left])
    out = []
    i = 0
    while i >= 0:
      t = self.ids.get(syms[i])
      if t is not None:
        out.append(t)
      else:  # llama.cpp looks each UTF-8 byte up as a one-byte string; only ASCII ones can be tokens
        out += [self.ids[chr(b)] for b in syms[i].encode() if b < 128 and chr(b) in self.ids]
      i = nxt[i]
    return out

  # ------------------------------------------------------------------ ids -> text
  def piece(self, i: int, special: bool = False) -> bytes:
    """llama_token_to_piece: bytes of token i (control / unknown tokens render as nothing unless ``special``)."""
    t, ty = self.tokens[i], self.types[i]
    if ty in (CONTROL, UNKNOWN, USER_DEFINED) or ty not in (NORMAL, BYTE):
      return t.encode() if (special or ty == USER_DEFINED) and ty != UNUSED else b""
    if ty == BYTE:
      return bytes([int(t[3:-1], 16)]) if self.model == "llama" else bytes([_byte_maps()[1].get(t, 0)])
    if self.model == "llama":
      return t.replace(SPACE, " ").encode()
    dec = _byte_maps()[1]
    return bytes(dec[c] for c in t if c in dec)

  def decode(self, ids, special: bool = False) -> str:
    return b"".join(self.piece(int(i), special) for i in ids).decode("utf-8", errors="replace")

  @property
  def n_tokens(self) -> int:
    return len(self.tokens)


def byte_vocab(vocab_size: int = 256) -> Vocab:
  """PrismLLM's byte tokenizer as an SPM vocabulary (ondevice/tokenizer.py)."""
  from ondevice.tokenizer import ByteTokenizer
  tok = ByteTokenizer(vocab_size)
  tokens, scores, types = tok.gguf_vocab()
  return Vocab("llama", tokens, [int(t) for t in types], scores, bos_id=tok.eos_id, eos_id=tok.eos_id, unk_id=0,
               add_bos=False, add_space_prefix=False, extra={"prismllm.tokenizer": "bytes"})


def load(path: str) -> Vocab:
  """The tokenizer.ggml.* metadata of a GGUF file (read_info checked the file first)."""
  from gguf import GGUFReader
  r = GGUFReader(path, "r")

  def arr(key, conv):
    f = r.fields.get(key)
    return None if f is None else [conv(f.parts[i]) for i in f.data]

  def val(key):
    f = r.fields.get(key)
    if f is None:
      return None
    v = f.parts[f.data[0]]
    return bytes(v).decode("utf-8") if f.types[0].name == "STRING" else v.tolist()[0]

  model = val("tokenizer.ggml.model")
  if model is None:
    raise VocabError(f"{path} has no tokenizer.ggml.model; pass token ids (--prompt-ids)")
  tokens = arr("tokenizer.ggml.tokens", lambda p: bytes(p).decode("utf-8"))
  types = arr("tokenizer.ggml.token_type", lambda p: int(p[0])) or [NORMAL] * len(tokens)
  ids = {k: val(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unk", "pad", "eot")}
  spm = model == "llama"
  return Vocab(model, tokens, types, arr("tokenizer.ggml.scores", lambda p: float(p[0])),
               arr("tokenizer.ggml.merges", lambda p: bytes(p).decode("utf-8")), val("tokenizer.ggml.pre"),
               ids["bos"] if ids["bos"] is not None else (1 if spm else 11),
               ids["eos"] if ids["eos"] is not None else (2 if spm else 11), ids["unk"], ids["pad"], ids["eot"],
               val("tokenizer.ggml.add_bos_token"), bool(val("tokenizer.ggml.add_eos_token") or False),
               val("tokenizer.ggml.add_space_prefix"), val("tokenizer.chat_template"))
