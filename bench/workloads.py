"""The routing suite's workloads: six traffic shapes as lists of :class:`TraceRequest`.

Every workload is a trace in the replay's own record type — arrival seconds, lengths and chained
512-token block ids — so prompts (``bench.prompts.PromptMapper``), calibration, the oracle, the
replay and the statistics are shared with the single-trace benchmark. The shapes:

- ``mooncake``: the Mooncake conversation slice of ``bench.routing`` (real trace; every request
  shares block 0).
- ``rag``: 4 tenants x 2 system prompts (1k-4k tokens) x 32 documents each (1k-12k tokens, Zipf
  popularity, s = 1.1) x a unique question (16-128 tokens); Poisson arrivals. Heavy reuse of
  long prefixes.
- ``chat``: multi-turn conversations; every turn resends a shared 512-token system prompt, the
  whole history (earlier messages and answers) and a new message. Turns per conversation are
  geometric with mean 6, cut at 30 (ShareGPT-like); messages ~150 and answers ~300 tokens
  (log-normal); 30 s mean think time; conversations start as a Poisson process that began 300 s
  before the slice, so the slice opens with hundreds of users mid-conversation.
- ``bursts``: the arrival times of the Azure 2023 code trace from its 510th second (inter-arrival
  CV 10.9 over the quick 90 s slice, 17.8 over the full 600 s) carrying the ``rag`` prefix
  structure.
- ``unique``: no reuse at all: every prompt is unique (no block ids), with the lengths of a
  ``rag`` prompt (2k-16k tokens, log-uniform) and Poisson arrivals, so routing can only balance
  load.
- ``longdoc``: 24 documents of 32k-56k tokens (about 1.06 M tokens together, more than one
  engine's KV cache of the benchmark's profile), each read by 4 users asking unique questions;
  Poisson arrivals. A router that spreads documents over engines keeps them cached; one that
  sends every document everywhere evicts them.

Rules:
- Generators are pure functions of their arguments: a seeded ``random.Random``, no clock, no
  global state; the same call gives the same list.
- Synthetic prefixes are whole 512-token blocks, so the block-id arithmetic of
  ``bench.traces.hit_rate`` and ``oracle_hit_rate`` is exact; the unique part of a prompt (a
  question, the newest message) is the tail that ``PromptMapper`` appends. In ``chat`` a turn
  shares the previous turn's full blocks only: up to 511 tokens per turn that a real engine
  would hit at its 16-token granularity count as misses here, for every router alike.
- Block ids of different workloads, tenants, documents and conversations never collide: each
  id is ``(kind << 48) | (entity << 12) | block``.
- Requests are sorted by arrival and indexed 0..n-1 (the index keys each prompt's unique tail).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_trace, take_slice

BLOCK = MOONCAKE_BLOCK_TOKENS
KIND_SYSTEM, KIND_DOC, KIND_CHAT, KIND_LONGDOC = 1, 2, 3, 4


def block_ids(kind: int, entity: int, blocks: int, first: int = 0) -> list[int]:
    return [(kind << 48) | (entity << 12) | b for b in range(first, first + blocks)]


def poisson_arrivals(rng: random.Random, rate_per_s: float, duration_s: float) -> list[float]:
    out: list[float] = []
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def _lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def _finish(reqs: Sequence[TraceRequest]) -> list[TraceRequest]:
    """Sorted by arrival, indexed 0..n-1."""
    ordered = sorted(reqs, key=lambda r: r.arrival_s)
    return [replace(r, index=i) for i, r in enumerate(ordered)]


# --- RAG / agents ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RagShape:
    """Tenants x system prompts x documents x questions; lengths in whole blocks."""

    tenants: int = 4
    system_prompts_per_tenant: int = 2
    documents_per_prompt: int = 32
    system_blocks: tuple[int, int] = (2, 8)  # 1k-4k tokens
    document_blocks: tuple[int, int] = (2, 24)  # 1k-12k tokens
    question_tokens: tuple[int, int] = (16, 128)
    output_tokens: tuple[int, int] = (32, 512)
    zipf_s: float = 1.1
    rate_per_s: float = 4.0


def _sized(seed: int, kind: int, entity: int, span: tuple[int, int]) -> int:
    """A fixed size per (kind, entity), log-uniform in ``span``: the same document is always
    the same length."""
    rng = random.Random(seed * 1_000_003 + kind * 7_919 + entity)
    lo, hi = span
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def rag_request(rng: random.Random, shape: RagShape, seed: int, arrival_s: float) -> TraceRequest:
    tenant = rng.randrange(shape.tenants)
    sp = tenant * shape.system_prompts_per_tenant + rng.randrange(shape.system_prompts_per_tenant)
    weights = zipf_weights(shape.documents_per_prompt, shape.zipf_s)
    doc = sp * shape.documents_per_prompt + rng.choices(range(shape.documents_per_prompt),
                                                        weights)[0]
    sys_blocks = _sized(seed, KIND_SYSTEM, sp, shape.system_blocks)
    doc_blocks = _sized(seed, KIND_DOC, doc, shape.document_blocks)
    ids = block_ids(KIND_SYSTEM, sp, sys_blocks) + block_ids(KIND_DOC, doc, doc_blocks,
                                                            first=sys_blocks)
    question = rng.randint(*shape.question_tokens)
    out = _lognormal_int(rng, 128, 0.8, *shape.output_tokens)
    return TraceRequest(0, arrival_s, len(ids) * BLOCK + question, out, tuple(ids))


def rag(duration_s: float, seed: int = 1, shape: RagShape = RagShape()) -> list[TraceRequest]:
    rng = random.Random(seed)
    arrivals = poisson_arrivals(rng, shape.rate_per_s, duration_s)
    return _finish([rag_request(rng, shape, seed, t) for t in arrivals])


def bursts(duration_s: float, seed: int = 2, start_s: float = 510.0,
           trace: str = "azure2023_code.csv", shape: RagShape = RagShape()) -> list[TraceRequest]:
    """The Azure code trace's arrival times (its own lengths dropped) with RAG prompts."""
    arrivals = [r.arrival_s for r in take_slice(load_trace(trace), start_s=start_s,
                                                 duration_s=duration_s)]
    rng = random.Random(seed)
    return _finish([rag_request(rng, shape, seed, t) for t in arrivals])


# --- multi-turn chat ------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatShape:
    conversations_per_s: float = 1.0
    mean_turns: float = 6.0
    max_turns: int = 30
    system_blocks: int = 1  # shared by every conversation
    message_median: float = 150.0
    answer_median: float = 300.0
    think_s: float = 30.0  # mean time between an answer and the next message
    warm_s: float = 300.0  # conversations start this long before the slice


def draw_turns(rng: random.Random, mean: float = 6.0, cap: int = 30) -> int:
    """Geometric on 1.. with the given mean, redrawn above ``cap`` (ShareGPT-like counts)."""
    p = 1.0 / mean
    while True:
        n = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
        if n <= cap:
            return n


def conversation(rng: random.Random, shape: ChatShape, conv: int,
                 start_s: float) -> list[TraceRequest]:
    """Every turn of one conversation: the history grows by an answer and a message a turn."""
    system = block_ids(KIND_SYSTEM, 1 << 20, shape.system_blocks)
    history = shape.system_blocks * BLOCK
    t = start_s
    out: list[TraceRequest] = []
    for _ in range(draw_turns(rng, shape.mean_turns, shape.max_turns)):
        history += _lognormal_int(rng, shape.message_median, 1.0, 8, 4096)
        answer = _lognormal_int(rng, shape.answer_median, 0.7, 16, 2048)
        full = (history - 2) // BLOCK - shape.system_blocks  # the tail keeps two unique tokens
        ids = system + block_ids(KIND_CHAT, conv, full, first=shape.system_blocks)
        out.append(TraceRequest(0, t, history, answer, tuple(ids)))
        history += answer
        t += rng.expovariate(1.0 / shape.think_s) + answer / 30.0  # reading at ~30 tokens/s
    return out


def chat(duration_s: float, seed: int = 3, shape: ChatShape = ChatShape()) -> list[TraceRequest]:
    rng = random.Random(seed)
    starts = poisson_arrivals(rng, shape.conversations_per_s, duration_s + shape.warm_s)
    reqs: list[TraceRequest] = []
    for conv, start in enumerate(starts):
        turns = conversation(rng, shape, conv, start - shape.warm_s)
        reqs += [r for r in turns if 0.0 <= r.arrival_s < duration_s]
    return _finish(reqs)


# --- no reuse, long documents ---------------------------------------------------------------

def unique(duration_s: float, seed: int = 5, rate_per_s: float = 2.0,
           input_tokens: tuple[int, int] = (2048, 16384)) -> list[TraceRequest]:
    """Unique prompts (no block ids: ``PromptMapper`` makes each one a tail of its own)."""
    rng = random.Random(seed)
    out = []
    for t in poisson_arrivals(rng, rate_per_s, duration_s):
        tokens = round(math.exp(rng.uniform(*(math.log(v) for v in input_tokens))))
        out.append(TraceRequest(0, t, tokens, _lognormal_int(rng, 128, 0.8, 32, 512)))
    return _finish(out)


@dataclass(frozen=True)
class LongDocShape:
    documents: int = 24
    users_per_document: int = 4
    document_blocks: tuple[int, int] = (64, 112)  # 32k-56k tokens
    question_tokens: tuple[int, int] = (16, 128)
    output_tokens: tuple[int, int] = (32, 512)
    rate_per_s: float = 1.0


def longdoc(duration_s: float, seed: int = 4,
            shape: LongDocShape = LongDocShape()) -> list[TraceRequest]:
    rng = random.Random(seed)
    out = []
    for t in poisson_arrivals(rng, shape.rate_per_s, duration_s):
        user = rng.randrange(shape.documents * shape.users_per_document)
        doc = user // shape.users_per_document
        ids = block_ids(KIND_LONGDOC, doc, _sized(seed, KIND_LONGDOC, doc, shape.document_blocks))
        question = rng.randint(*shape.question_tokens)
        answer = _lognormal_int(rng, 128, 0.8, *shape.output_tokens)
        out.append(TraceRequest(0, t, len(ids) * BLOCK + question, answer, tuple(ids)))
    return _finish(out)


def mooncake(duration_s: float, start_s: float = 0.0) -> list[TraceRequest]:
    return take_slice(load_trace("mooncake_conversation.jsonl"), start_s=start_s,
                      duration_s=duration_s)


# --- the suite's table of workloads ---------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """A named shape, its slice lengths (trace seconds) and its input cap."""

    name: str
    title: str
    make: Callable[[float], list[TraceRequest]]
    full_s: float
    quick_s: float
    max_input_tokens: int = 16384

    def requests(self, quick: bool) -> list[TraceRequest]:
        return self.make(self.quick_s if quick else self.full_s)


WORKLOADS: tuple[Workload, ...] = (
    Workload("mooncake", "Mooncake conversation slice", mooncake, 600.0, 100.0),
    Workload("rag", "RAG / agents: tenants x long shared prefixes, Zipf", rag, 600.0, 120.0),
    Workload("chat", "multi-turn chat, whole history resent", chat, 600.0, 240.0),
    Workload("bursts", "Azure code arrivals (bursty) with RAG prefixes", bursts, 600.0, 90.0),
    Workload("unique", "no reuse: unique prompts, RAG-like lengths", unique, 600.0, 180.0),
    Workload("longdoc", "few long documents (32k-56k tokens), a handful of users each",
             longdoc, 600.0, 80.0, max_input_tokens=57344 + 128),
)


def by_name(names: str | None) -> list[Workload]:
    """``None`` or ``"all"``: every workload; else a comma list of names."""
    if not names or names == "all":
        return list(WORKLOADS)
    known = {w.name: w for w in WORKLOADS}
    out = []
    for name in filter(None, (s.strip() for s in names.split(","))):
        if name not in known:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(known)}")
        out.append(known[name])
    return out
