"""The idle floor of a workload's TTFT: what no router can beat, on the simulator's model.

Each request's floor is its time to first token alone on an idle engine that holds every
prompt block any *earlier* request carried (by arrival), with nothing evicted and no wait for
an earlier request's prefill to finish. Any router, on any number of engines, gives each request
at least that: a block no earlier request carried is cached nowhere; alone, the engine computes
the prompt in the fewest steps (the whole step budget each), and another sequence in a step only
adds to that step's time (the profile's step time grows with the tokens and context in it; a
token of the budget another sequence takes costs the step more than the attention it spares this
prompt's chunk); and a request cannot start before it arrives. So each percentile of the
floors bounds the same percentile of any router's TTFTs from below, and a target under the
floor is one that no router can meet on that workload.

Rules:
- The engine is the simulator's own: its scheduler (chunked prefill, ``max_num_batched_tokens``
  per step, the last prompt token always computed), its block pool and the profile's step time,
  with the same prompts as ``bench.routing`` and ``bench.replay`` (``PromptMapper``, the chat
  template). Figures are engine seconds, as the suite reports latencies.
- Pure: a function of its arguments; no clock, no I/O.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bench.prompts import PromptMapper
from bench.stats import percentile
from bench.traces import TraceRequest

if TYPE_CHECKING:
    from engine_sidecar.sim.profiles import Profile

BLOCK_TOKENS = 16  # the simulator's KV block size, as the suite's fleet runs it
STEP_TOKENS = 8192  # the simulator's max_num_batched_tokens, as the suite's fleet runs it
RULE = ("each request alone on an idle engine holding every prompt block an earlier request "
        "carried: no router can give a request less")


def idle_floors(reqs: Sequence[TraceRequest], profile: str, *,
                step_tokens: int = STEP_TOKENS) -> list[float]:
    """Each request's floor TTFT (engine seconds), in the order of ``reqs`` (module rules)."""
    from engine_sidecar.sim.kvcache import BlockPool  # noqa: PLC0415 - the simulator's model
    from engine_sidecar.sim.profiles import PROFILES  # noqa: PLC0415
    from engine_sidecar.sim.tokenizer import chat_prompt, encode  # noqa: PLC0415

    prof = PROFILES[profile]
    hasher = BlockPool(1, BLOCK_TOKENS)  # only its chain hashing: the engines' block keys
    mapper, seen, out = PromptMapper(), set[bytes](), []
    for req in sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s):
        ids = array("I", encode(chat_prompt([{"role": "user", "content":
                                              mapper.prompt(reqs[req])}])))
        chain = hasher.chain(ids)
        held = 0
        while held < len(chain) and chain[held] in seen:
            held += 1
        out.append((req, alone_ttft(prof, ids, held * BLOCK_TOKENS, step_tokens)))
        seen.update(chain)
    return [t for _, t in sorted(out)]


def alone_ttft(prof: Profile, ids: array[int], cached: int, step_tokens: int) -> float:
    """Seconds to the first token of prompt ``ids`` alone on an idle engine that holds its first
    ``cached`` tokens (whole blocks): the simulator's scheduler, step by step."""
    from engine_sidecar.sim.kvcache import BlockPool  # noqa: PLC0415
    from engine_sidecar.sim.scheduler import Scheduler, SimRequest  # noqa: PLC0415
    from engine_sidecar.sim.tokenizer import WordStream  # noqa: PLC0415

    blocks = -(-len(ids) // BLOCK_TOKENS) * 2 + 16
    sched = Scheduler(BlockPool(blocks, BLOCK_TOKENS), max_num_seqs=256,
                      max_num_batched_tokens=step_tokens, policy="fcfs", spec_acceptance=(),
                      rng=random.Random(0))

    def request(tokens: array[int], name: str) -> SimRequest:
        return SimRequest(request_id=name, token_ids=array("I", tokens), prompt_len=len(tokens),
                          target_len=1, finish_reason="length", priority=0, seq=0,
                          words=WordStream(0))

    if cached:
        sched.add(request(ids[:cached], "held"))  # computed before, in no time: the cache
        while sched.has_work:
            sched.complete(sched.schedule())
    own = request(ids, "own")
    sched.add(own)
    elapsed = 0.0
    while True:
        plan = sched.schedule()
        elapsed += prof.step_time(plan.batched_tokens, plan.context_tokens, plan.attn_work,
                                  plan.draft_len)
        if any(o.request is own for o in sched.complete(plan)):
            return elapsed


def floor_percentiles(floors: Sequence[float]) -> dict[str, float]:
    """The floors' TTFT p50, p90 and p99, keyed as the routing summaries are."""
    return {f"ttft_p{q}": percentile(list(floors), q) for q in (50, 90, 99)}
