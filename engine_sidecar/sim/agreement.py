"""Greedy answers that continue consistently, draft models that agree with them, and the
``prompt_logprobs`` a simulated engine reports.

Rules:
- **Consistent continuation**: a greedy prompt that ends with generated words (the simulator's
  vocabulary or its EOS token) is read as an *anchor* (the prompt before them) plus an answer
  begun. The answer is the anchor's greedy answer continued from that position, whatever the
  words actually given were: so a target asked for ``prompt + its own first k tokens`` produces
  its token ``k + 1``, exactly what it produced alone (what speculative-first verification needs).
- **Draft agreement**: a draft engine (``draft_agreement`` < 1) emits, at each answer position,
  the target's word with that probability and another word otherwise; the draw is a hash of the
  anchor's seed and the position, so it is the same on every call. The end of the answer (EOS)
  is where the target's is.
- **Prompt logprobs**, as vLLM 0.32 reports them: one entry per prompt position, ``None`` at 0,
  each a ``{token_id: {logprob, rank, decoded_token}}`` map with the top ``k`` tokens (rank 1
  first) plus the prompt's own token with its rank. Inside the anchor the prompt's own token is
  the top-1 (the simulator models no prompt surprise); inside the answer begun, the top-1 is the
  engine's own greedy token at that position.
- Pure: no clock, no engine state.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

from engine_sidecar.sim.tokenizer import (
    EOS_ID,
    EOS_INDEX,
    GENERATED_IDS,
    TOKEN_IDS,
    TOKEN_TEXT,
    WordStream,
    decode,
    token_logprob,
)

_ALT_STRIDE = 37
_PROMPT_LOGPROB = -0.25


def answer_begun(prompt_ids: array[int]) -> int:
    """How many of the prompt's last tokens are generated ones (the answer begun)."""
    n = len(prompt_ids)
    i = n
    while i > 0 and prompt_ids[i - 1] in GENERATED_IDS:
        i -= 1
    return n - i


def _unit(seed: int, position: int) -> float:
    digest = hashlib.blake2b(position.to_bytes(8, "little"), digest_size=8,
                             key=(seed & ((1 << 64) - 1)).to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") / float(1 << 64)


class AnswerWords(WordStream):
    """The word stream of one greedy or seeded answer from position ``start`` on: the target's
    words, or a draft's that agree with them with probability ``agreement``; EOS at ``stop_at``
    (the last position of an answer that stops by itself), if given."""

    __slots__ = ("agreement", "only", "position", "seed", "stop_at")

    def __init__(self, seed: int, *, agreement: float = 1.0, start: int = 0,
                 stop_at: int | None = None, only: int | None = None) -> None:
        super().__init__(seed)
        self.seed = seed
        self.only = only
        self.agreement = agreement
        self.position = 0
        self.stop_at = stop_at
        for _ in range(start):
            self.next()

    def next(self) -> int:
        word = super().next()
        pos = self.position
        self.position += 1
        if self.only is not None:
            return self.only
        if self.stop_at is not None and pos >= self.stop_at:
            return EOS_INDEX
        if self.agreement >= 1.0 or _unit(self.seed, pos) < self.agreement:
            return word
        return (word + 1 + int(_unit(self.seed ^ 0x5EED, pos) * 255)) % 256


def prompt_logprobs(prompt_ids: array[int], begun: int, words: AnswerWords, k: int
                    ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` for ``prompt_ids`` (see the module rules); ``words`` is the
    engine's answer stream at position 0 of the answer, ``k`` the top tokens wanted (>= 1)."""
    anchor = len(prompt_ids) - begun
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for p in range(1, min(anchor, len(prompt_ids))):
        token = prompt_ids[p]
        out.append({str(token): {"logprob": _PROMPT_LOGPROB, "rank": 1,
                                 "decoded_token": decode([token])}})
    for i in range(begun):
        if anchor + i == 0:
            words.next()
            continue
        out.append(_answer_entry(words.next(), prompt_ids[anchor + i], i, k))
    return out


def _answer_entry(top: int, actual: int, position: int, k: int) -> dict[str, dict[str, Any]]:
    best = token_logprob(top, position)
    ranked = [top] + [(top + r * _ALT_STRIDE + position) % 256 for r in range(1, k)]
    entry: dict[str, dict[str, Any]] = {}
    for rank, index in enumerate(dict.fromkeys(ranked), start=1):
        entry[str(TOKEN_IDS[index])] = {"logprob": best - 0.7 * (rank - 1) - 0.1 * (rank > 1),
                                        "rank": rank, "decoded_token": TOKEN_TEXT[index]}
    if str(actual) not in entry:
        entry[str(actual)] = {"logprob": best - 9.0, "rank": 1000,
                              "decoded_token": "" if actual == EOS_ID else decode([actual])}
    return entry
