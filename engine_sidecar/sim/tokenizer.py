"""Deterministic tokenizer and text generator of the simulator.

Rules:
- **Tokenizing**: the UTF-8 bytes of a text, zero-padded to a multiple of 4, are cut into 4-byte
  chunks; each chunk is one token whose id is the chunk read as a little-endian uint32. So a text of
  ``b`` bytes has ``ceil(b / 4)`` tokens, equal texts give equal ids, and a shared prefix of whole
  chunks gives shared ids (what prefix caching needs). It runs at C speed (``array``).
- **Chat template**: each message becomes ``<|role|>\\n`` + content + ``\\n``; the prompt ends with
  ``<|assistant|>\\n``. Only text parts of multimodal content count.
- **Generating**: every output token is one word of exactly 4 bytes (a space and three letters) from
  a fixed 256-word vocabulary, so generated text re-tokenizes to the same count. Words come from a
  64-bit LCG: seeded from the prompt for temperature 0, from the prompt and ``seed`` when a seed is
  given, from the engine's RNG otherwise. Log-probabilities derive from the same state.
- **End of sequence**: an answer that stops by itself (``finish_reason: "stop"``) ends with the
  token ``EOS_ID`` (word index ``EOS_INDEX``, no text), counted in the answer's tokens and returned
  in its ``token_ids`` as vLLM does; ``/detokenize`` renders it as nothing.
"""

from __future__ import annotations

import hashlib
import math
from array import array

_MASK = (1 << 64) - 1
_MUL = 6364136223846793005
_INC = 1442695040888963407
_CONSONANTS = "bcdfghklmnprstvw"
_VOWELS = "aeiou"


def _vocabulary() -> tuple[str, ...]:
    words = []
    for i in range(256):
        c1 = _CONSONANTS[i % 16]
        v = _VOWELS[(i // 16) % 5]
        c2 = _CONSONANTS[(i * 7 + i // 16) % 16]
        words.append(f" {c1}{v}{c2}")
    return tuple(words)


VOCAB: tuple[str, ...] = _vocabulary()
VOCAB_IDS: tuple[int, ...] = tuple(
    int.from_bytes(w.encode(), "little") for w in VOCAB
)


EOS_INDEX = 256
EOS_ID = 2  # the bytes 02 00 00 00: no text of printable characters encodes to it
# Word index -> text and token id, the end-of-sequence token included.
TOKEN_TEXT: tuple[str, ...] = (*VOCAB, "")
TOKEN_IDS: tuple[int, ...] = (*VOCAB_IDS, EOS_ID)
GENERATED_IDS: frozenset[int] = frozenset(TOKEN_IDS)


def decode(ids: list[int]) -> str:
    """The text of token ids: their bytes without the zero padding (the EOS token is empty)."""
    kept = array("I", [i for i in ids if i != EOS_ID and 0 <= i < 1 << 32])
    data = kept.tobytes().replace(b"\0", b"")
    return data.decode("utf-8", errors="replace")


def encode(text: str) -> array[int]:
    """Token ids of ``text`` (see the module rules)."""
    data = text.encode("utf-8")
    pad = -len(data) % 4
    if pad:
        data += b"\0" * pad
    ids = array("I")
    ids.frombytes(data)
    return ids


def count_tokens(text: str) -> int:
    return (len(text.encode("utf-8")) + 3) // 4


def chat_prompt(messages: list[dict[str, object]]) -> str:
    """The prompt text of a chat request under the simulator's template."""
    parts: list[str] = []
    for message in messages:
        role = message.get("role", "user")
        parts.append(f"<|{role}|>\n{_content_text(message.get('content'))}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _content_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        ]
        return "".join(texts)
    raise ValueError("message content must be a string or a list of content parts")


def text_seed(text: str, extra: int = 0) -> int:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=extra.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little")


class WordStream:
    """Generates output words from a 64-bit LCG; ``next()`` gives a vocabulary index."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK

    def next(self) -> int:
        self.state = (self.state * _MUL + _INC) & _MASK
        return self.state >> 56


def token_logprob(index: int, position: int) -> float:
    """A plausible, deterministic log-probability of the chosen word at an output position."""
    return -((index * 2654435761 + position * 40503) % 1000) / 1000.0 * 1.5 - 0.005


def top_logprobs(index: int, position: int, k: int) -> list[tuple[str, float]]:
    """``k`` alternatives, the chosen word first, each less likely than the one before."""
    chosen = token_logprob(index, position)
    out = [(TOKEN_TEXT[index], chosen)]
    for rank in range(1, k):
        alt = (index + rank * 37 + position) % 256
        if alt == index:
            alt = (alt + 1) % 256
        out.append((VOCAB[alt], chosen - 0.7 * rank - math.log1p(rank)))
    return out
