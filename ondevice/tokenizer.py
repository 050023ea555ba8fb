"""PrismLLM's byte-level tokenizer (id = byte value) and its GGUF form that llama.cpp can run.

llama.cpp has no "bytes" tokenizer, so the vocabulary is written as a SentencePiece ("llama") vocab
whose SPM tokenizer reproduces byte ids exactly:
* printable ASCII 0x21-0x7E: a NORMAL token whose text is the character itself;
* space 0x20: NORMAL token "\u2581" (SPM always escapes ' ' to U+2581 before lookup; add_space_prefix
  is written as false so no leading space is added);
* every other byte: a BYTE token "<0xXX>", which SPM's byte fallback uses for characters not in the
  vocab (newline, tabs, and each UTF-8 byte of non-ASCII characters);
* ids >= 256 (padding of a larger vocab): "<extra_N>" CONTROL tokens.
No two tokens concatenate to another token, so SPM never merges: text -> UTF-8 bytes -> ids.
Limitation: a literal U+2581 character in a prompt is read by llama.cpp as a space.
"""
from __future__ import annotations

import dataclasses

SPACE_PIECE = "\u2581"


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  vocab_size: int = 256

  @property
  def eos_id(self) -> int:
    """Stop token: the first extra id when the vocab has one, else byte 0 (NUL never occurs in text)."""
    return 256 if self.vocab_size > 256 else 0

  def encode(self, text: str) -> list:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

  def gguf_vocab(self):
    """(tokens, scores, token types) for GGUF's tokenizer.ggml.* keys."""
    from gguf import TokenType
    tokens, types = [], []
    for i in range(self.vocab_size):
      if i >= 256:
        tokens.append(f"<extra_{i - 256}>")
        types.append(TokenType.CONTROL)
      elif i == 0x20:
        tokens.append(SPACE_PIECE)
        types.append(TokenType.NORMAL)
      elif 0x21 <= i <= 0x7E:
        tokens.append(chr(i))
        types.append(TokenType.NORMAL)
      else:
        tokens.append(f"<0x{i:02X}>")
        types.append(TokenType.BYTE)
    return tokens, [0.0] * self.vocab_size, types
