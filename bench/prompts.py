"""Turning trace requests into prompt text, and the synthetic shared-prefix workload.

Rules:
- A token is a three-letter lowercase word followed by one space: four characters. The simulated
  engines count tokens from characters (four per token), and a whitespace-word tokenizer would count
  the same, so a block of ``n`` tokens is exactly ``4 * n`` characters and ``n`` words.
- The same ``hash_id`` always gives the same block text (seeded by the id and the mapping's seed);
  that is what turns the trace's prefix sharing into prefix sharing of prompts.
- Every request ends with a tail that no other request has (its first two words spell its trace
  index), so that only the hash blocks can hit a cache.
- Pure and deterministic: no clock, no global random state.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import product

from bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_trace, take_slice

CHARS_PER_TOKEN = 4
_WORDS: tuple[str, ...] = tuple(
    "".join(p) + " " for p in product(string.ascii_lowercase, repeat=CHARS_PER_TOKEN - 1)
)
_TAIL_SALT = 0x7A11
TAIL_MIN_TOKENS = 2


def token_count(text: str) -> int:
    """Tokens of ``text`` under the mapping's rule (what the simulator counts for it)."""
    return -(-len(text) // CHARS_PER_TOKEN)


def random_tokens(rng: random.Random, tokens: int) -> str:
    return "".join(rng.choices(_WORDS, k=tokens))


@dataclass
class PromptMapper:
    """Maps trace requests to prompt text; caches block texts so repeated ids cost nothing."""

    seed: int = 0
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        self._blocks: dict[int, str] = {}

    def block(self, hash_id: int) -> str:
        text = self._blocks.get(hash_id)
        if text is None:
            rng = random.Random((self.seed << 40) ^ (hash_id + 1))
            text = random_tokens(rng, self.block_tokens)
            self._blocks[hash_id] = text
        return text

    def tail(self, index: int, tokens: int) -> str:
        """``tokens`` tokens (at least ``TAIL_MIN_TOKENS``), the first two spelling the index."""
        tokens = max(TAIL_MIN_TOKENS, tokens)
        n = len(_WORDS)
        head = _WORDS[(index // n) % n] + _WORDS[index % n]
        rng = random.Random((self.seed << 40) ^ (_TAIL_SALT << 32) ^ index)
        return head + random_tokens(rng, tokens - TAIL_MIN_TOKENS)

    def prompt(self, req: TraceRequest) -> str:
        """Text of ``req.input_tokens`` tokens: the hash blocks, then a tail unique to the request.

        The last hash id of a Mooncake request names a partial block; it is emitted cut to what
        is left of ``input_length`` less the tail, so that a repeated request repeats it too.
        Requests shorter than ``TAIL_MIN_TOKENS`` come out at ``TAIL_MIN_TOKENS``.
        """
        parts: list[str] = []
        budget = req.input_tokens - TAIL_MIN_TOKENS
        used = 0
        for h in req.hash_ids:
            take = min(self.block_tokens, budget - used)
            if take <= 0:
                break
            block = self.block(h)
            parts.append(block if take == self.block_tokens else block[: take * CHARS_PER_TOKEN])
            used += take
        parts.append(self.tail(req.index, req.input_tokens - used))
        return "".join(parts)


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """Tenants x system prompts x documents x questions, with Poisson arrivals.

    Every request is ``system prompt + document + question``; system prompts are shared by a
    tenant's requests, documents are drawn with a Zipf-like popularity, questions are unique.
    Expressed as trace requests with synthetic block ids, so the same prompt mapping and hit-rate
    arithmetic apply as for the Mooncake trace.
    """

    tenants: int = 4
    system_prompts_per_tenant: int = 2
    documents_per_tenant: int = 16
    system_tokens: int = 1024
    document_tokens: int = 4096
    question_tokens: int = 64
    output_tokens: int = 128
    rate_per_s: float = 4.0
    zipf_s: float = 1.1
    seed: int = 0
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def _ids(self, kind: int, tenant: int, item: int, blocks: int, offset: int) -> list[int]:
        # Chained ids: a document's blocks belong under its system prompt's blocks.
        base = ((kind * 1_000 + tenant) * 10_000 + item) * 1_000_000 + offset * 1_000
        return [base + b for b in range(blocks)]

    def requests(self, count: int) -> list[TraceRequest]:
        rng = random.Random(self.seed)
        weights = [1.0 / (k + 1) ** self.zipf_s for k in range(self.documents_per_tenant)]
        sys_blocks = -(-self.system_tokens // self.block_tokens)
        doc_blocks = -(-self.document_tokens // self.block_tokens)
        out: list[TraceRequest] = []
        t = 0.0
        for i in range(count):
            t += rng.expovariate(self.rate_per_s)
            tenant = rng.randrange(self.tenants)
            sp = rng.randrange(self.system_prompts_per_tenant)
            doc = rng.choices(range(self.documents_per_tenant), weights)[0]
            ids = self._ids(1, tenant, sp, sys_blocks, 0)
            ids += self._ids(2, tenant, sp * self.documents_per_tenant + doc, doc_blocks, 1)
            inp = (sys_blocks + doc_blocks) * self.block_tokens + self.question_tokens
            out.append(TraceRequest(i, t, inp, self.output_tokens, tuple(ids)))
        return out


SYNTHETIC = "synthetic"


def workload(name: str, *, duration_s: float, start_s: float = 0.0) -> list[TraceRequest]:
    """A trace slice by name, or ``"synthetic"``: the shared-prefix workload over ``duration_s``."""
    if name == SYNTHETIC:
        w = SharedPrefixWorkload()
        return w.requests(round(w.rate_per_s * duration_s))
    return take_slice(load_trace(name), start_s=start_s, duration_s=duration_s)


def iter_prompts(mapper: PromptMapper, reqs: Sequence[TraceRequest]) -> Iterator[str]:
    for req in reqs:
        yield mapper.prompt(req)
