"""Continuous-batching scheduler of one simulated engine, shaped after vLLM's v1 scheduler.

Rules:
- One call to ``schedule`` plans one engine step under a token budget (``max_num_batched_tokens``):
  running requests first (a decode token each, plus draft tokens when speculating, or the next chunk
  of a prefill), then waiting requests in policy order while fewer than ``max_num_seqs`` run.
- The draft length of a step is ``k_lookup[b]`` for ``b`` running requests when the step is
  planned (vLLM's batch-size schedule; by default every entry is the maximum K); each request
  accepts drafts with its own per-position acceptance (``SimRequest.acceptance``, else the
  scheduler's default).
- ``fcfs`` serves the waiting queue in arrival order; ``priority`` by (priority, arrival), lower
  first.
- When a running request needs a block and none is free, the scheduler preempts (recompute): the
  latest-arrived running request under ``fcfs``, the lowest-priority one under ``priority``. The
  victim releases its blocks and goes back to the head of the waiting queue with its output kept.
  No new request is admitted in a step that preempted.
- A request that asks for ``prompt_logprobs`` does not read the prefix cache (``read_cache``
  False): vLLM 0.32 sets ``skip_reading_prefix_cache`` for it, because the log-probabilities of
  cached positions are never computed; it recomputes its whole prompt, is not counted as a
  prefix-cache query, and still leaves its blocks in the cache for others.
- ``complete`` applies a planned step: computed tokens advance, full blocks are registered in the
  prefix cache, finished prefills and decodes sample tokens; accepted draft tokens add tokens
  without extra steps. Pure and synchronous: the clock and the sleeping belong to the engine.
"""

from __future__ import annotations

import heapq
import random
from array import array
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from engine_sidecar.sim.kvcache import BlockPool
from engine_sidecar.sim.tokenizer import TOKEN_IDS, WordStream
from proxy.core.blockhash import PLAIN_ROOT, ChainRoot


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


FinishReason = Literal["stop", "length"]


@dataclass(eq=False)
class SimRequest:
    """One sequence inside the engine. ``token_ids`` is the prompt followed by the output so far."""

    request_id: str
    token_ids: array[int]
    prompt_len: int
    target_len: int
    finish_reason: FinishReason
    priority: int
    seq: int
    words: WordStream
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_registered: int = 0
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    root: ChainRoot = PLAIN_ROOT  # start of the hash chain (``cache_salt`` keys the first block)
    status: Status = Status.WAITING
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    acceptance: tuple[float, ...] = ()  # conditional per draft position; () = engine default
    read_cache: bool = True  # False: prompt_logprobs wanted (vLLM skips the prefix-cache lookup)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def remaining(self) -> int:
        return self.target_len - len(self.output)

    def __lt__(self, other: SimRequest) -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


@dataclass
class Scheduled:
    request: SimRequest
    num_new: int
    num_draft: int


@dataclass
class StepPlan:
    items: list[Scheduled]
    preempted: list[SimRequest]
    batched_tokens: int = 0
    context_tokens: int = 0
    attn_work: int = 0
    draft_tokens: int = 0
    draft_len: int = 0  # K of this step: the draft model's sequential passes


@dataclass
class StepOutput:
    request: SimRequest
    new_words: list[int]
    finished: bool


@dataclass
class SchedulerStats:
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, pool: BlockPool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str, spec_acceptance: tuple[float, ...], rng: random.Random) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.priority = policy == "priority"
        self.acceptance = spec_acceptance
        self.rng = rng
        self.running: list[SimRequest] = []
        self._fifo: deque[SimRequest] = deque()
        self._heap: list[SimRequest] = []
        self.num_waiting = 0
        self.stats = SchedulerStats(spec_accepted_per_pos=[0] * len(spec_acceptance))
        self.k_lookup: tuple[int, ...] = (0, *([len(spec_acceptance)] * max_num_seqs))
        self._step_k = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, req: SimRequest) -> None:
        req.block_hashes = self.pool.chain(req.token_ids, req.root)
        self._push_waiting(req, front=False)

    def _push_waiting(self, req: SimRequest, *, front: bool) -> None:
        req.status = Status.WAITING
        self.num_waiting += 1
        if self.priority:
            heapq.heappush(self._heap, req)
        elif front:
            self._fifo.appendleft(req)
        else:
            self._fifo.append(req)

    def _peek_waiting(self) -> SimRequest | None:
        queue = self._heap if self.priority else self._fifo
        while queue and queue[0].status is not Status.WAITING:
            if self.priority:
                heapq.heappop(self._heap)
            else:
                self._fifo.popleft()
        return queue[0] if queue else None

    def _pop_waiting(self) -> None:
        if self.priority:
            heapq.heappop(self._heap)
        else:
            self._fifo.popleft()
        self.num_waiting -= 1

    def abort(self, req: SimRequest) -> None:
        """Remove a request wherever it is and free its blocks; waiting entries go lazily."""
        if req.status is Status.WAITING:
            self.num_waiting -= 1
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            self.pool.release(req.blocks)
            req.blocks = []
        req.status = Status.ABORTED

    # -- planning ----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan(items=[], preempted=[])
        self._step_k = self.k_lookup[min(len(self.running), self.max_num_seqs)]
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        for item in plan.items:
            req = item.request
            context = req.num_computed + item.num_new
            plan.batched_tokens += item.num_new
            plan.context_tokens += context
            plan.attn_work += item.num_new * context
            plan.draft_tokens += item.num_draft
            plan.draft_len = max(plan.draft_len, item.num_draft)
        return plan

    def _wanted(self, req: SimRequest, budget: int) -> tuple[int, int]:
        todo = req.num_tokens - req.num_computed
        if todo == 1 and self.acceptance:
            # Like vLLM, the drafter proposes all k positions even when fewer tokens remain.
            drafts = max(0, min(self._step_k, budget - 1))
            return 1 + drafts, drafts
        return min(todo, budget), 0

    def _grow(self, req: SimRequest, num_new: int) -> bool:
        bs = self.pool.block_size
        need = -(-(req.num_computed + num_new) // bs) - len(req.blocks)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new, drafts = self._wanted(req, budget)
            while not self._grow(req, num_new):
                victim = self._victim()
                index = self.running.index(victim)
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    return budget
                if index < i:  # already planned this step: take it back out
                    i -= 1
                    budget += self._unplan(plan, victim)
            plan.items.append(Scheduled(req, num_new, drafts))
            budget -= num_new
            i += 1
        return budget

    @staticmethod
    def _unplan(plan: StepPlan, victim: SimRequest) -> int:
        for item in plan.items:
            if item.request is victim:
                plan.items.remove(item)
                return item.num_new
        return 0

    def _victim(self) -> SimRequest:
        if self.priority:
            return max(self.running)
        return self.running[-1]

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_registered = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self._push_waiting(req, front=True)

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        bs = self.pool.block_size
        while budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._peek_waiting()
            if req is None:
                return
            hits = self.pool.lookup(req.block_hashes[: (req.num_tokens - 1) // bs]) \
                if req.read_cache else []
            self.pool.touch(hits)
            req.blocks = hits
            req.num_computed = req.num_registered = len(hits) * bs
            num_new = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, num_new):
                self.pool.release(hits)
                req.blocks = []
                req.num_computed = req.num_registered = 0
                return
            self._pop_waiting()
            self._admit(req, plan, num_new)
            budget -= num_new

    def _admit(self, req: SimRequest, plan: StepPlan, num_new: int) -> None:
        if req.read_cache:
            self.stats.prefix_queries += req.num_tokens
            self.stats.prefix_hits += req.num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed
        req.status = Status.RUNNING
        self.running.append(req)
        plan.items.append(Scheduled(req, num_new, 0))

    # -- applying ----------------------------------------------------------------------------

    def complete(self, plan: StepPlan) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        finished = False
        for item in plan.items:
            req = item.request
            if req.status is not Status.RUNNING:
                continue  # aborted while the step ran
            out = self._advance(req, item)
            if out is not None:
                outputs.append(out)
                finished = finished or out.finished
        if finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return outputs

    def _advance(self, req: SimRequest, item: Scheduled) -> StepOutput | None:
        accepted = self._accept(item.num_draft, req.acceptance or self.acceptance) \
            if item.num_draft else 0
        req.num_computed += item.num_new - item.num_draft + accepted
        self._register_blocks(req)
        if req.num_computed < req.num_tokens:
            return None  # a prefill chunk that did not reach the end
        if not req.output:
            self.stats.prompt_tokens += req.prompt_len
        words = [req.words.next() for _ in range(min(1 + accepted, req.remaining))]
        req.output.extend(words)
        req.token_ids.extend(TOKEN_IDS[w] for w in words)
        self.stats.generation_tokens += len(words)
        self._extend_hashes(req)
        done = req.remaining <= 0
        if done:
            req.status = Status.FINISHED
            self.pool.release(req.blocks)
            req.blocks = []
        return StepOutput(req, words, done)

    def _accept(self, drafts: int, acceptance: tuple[float, ...]) -> int:
        stats = self.stats
        stats.spec_drafts += 1
        stats.spec_draft_tokens += drafts
        accepted = 0
        for pos in range(drafts):
            if self.rng.random() >= acceptance[min(pos, len(acceptance) - 1)]:
                break
            stats.spec_accepted_per_pos[pos] += 1
            accepted += 1
        stats.spec_accepted += accepted
        return accepted

    def _register_blocks(self, req: SimRequest) -> None:
        full = min(req.num_computed // self.pool.block_size, len(req.block_hashes))
        self.pool.cache_full_blocks(req.blocks, req.block_hashes,
                                    req.num_registered // self.pool.block_size, full,
                                    ids=req.token_ids, root=req.root)
        req.num_registered = max(req.num_registered, full * self.pool.block_size)

    def _extend_hashes(self, req: SimRequest) -> None:
        have = len(req.block_hashes)
        if req.num_tokens // self.pool.block_size > have:
            parent = req.block_hashes[-1] if have else req.root
            req.block_hashes.extend(self.pool.chain(req.token_ids, parent, start_block=have))
