"""One speculative-first answer: admission on both pools, then rounds of draft chunk → target
verification → verified tokens to the client.

Rules:
- Both pools admit the request first (the same class thresholds as any request); a target pool
  that would shed sheds it (503 before any byte), a draft pool that would shed turns it into a
  pass-through (``PassThrough``, before any byte: the normal path serves it from the target).
- The prompt is rendered to token ids once, by the target engine's ``/tokenize``; every later
  call carries token ids, so nothing is re-tokenized.
- Rounds follow ``proxy.core.specfirst``: draft up to the history's chunk, verify in one target
  prefill pass, keep the agreeing prefix and the target's own token. A token whose role (stop or
  go on) the target has not shown yet is asked of the target before it is used.
- Streaming: verified text only, one chunk per round, never ahead of verification; the client's
  response starts with the first verified text, so a failure before it is a plain HTTP error.
- A draft engine failing midway is dropped and the answer goes on with the target alone, from
  the verified prefix (rounds of the target's own tokens). A target engine failing midway is
  replaced by the next one of the ranking, once: the verified state lives here, so the answer
  stays exact. Cancellation (the client left) closes whichever engine call is open.
- Headers ``X-Draft-Tokens`` / ``X-Target-Tokens`` say who wrote the answer's tokens (for a
  stream, known only at its end: an SSE comment line before ``[DONE]`` carries them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.core.admission import Admit, Priority, engine_priority
from proxy.core.errors import (
    ClientError,
    KvproxyError,
    NoCapacity,
    NoEngine,
    UpstreamError,
    UpstreamTimeout,
)
from proxy.core.inbound import Endpoint, Inbound
from proxy.core.pools import upstream_model
from proxy.core.prefix import prefix_chain
from proxy.core.routing import EngineView, RouteKey
from proxy.core.specfirst import Round, Step, advance, settle, verify_greedy, verify_sampled
from proxy.core.specshape import (
    DONE,
    Detok,
    Shape,
    error_event,
    role_chunk,
    text_chunk,
    usage_chunk,
    visible,
    whole,
)
from proxy.core.usage import Usage, asks_for_usage
from proxy.fleet.upstream import request_headers
from proxy.observe.specmetrics import SpecFirstMetrics
from proxy.server import speclegs
from proxy.server.context import ShellContext
from proxy.server.job import Job
from proxy.server.relay import CLIENT_CLOSED
from proxy.server.specfirst import Drafting
from proxy.server.speclegs import Leg, LegFailed, Verified

log = logging.getLogger(__name__)

TARGET_ONLY_CHUNK = 16  # tokens per target call once the draft is gone
APPROX_TOP_K = 8
# The client's sampling fields every leg carries as they are; ``cache_salt`` and ``priority`` are
# each pool's own (``SpecAnswer._carried``), as for any request sent to that pool.
_SAMPLING = ("top_p", "top_k", "min_p", "seed", "skip_special_tokens")


class EngineRefused(ClientError):
    """The target engine refused the request itself (a 4xx that is not 429): a 400 with the
    engine's own message, as the target pool would have answered without drafting."""

    default_code = "engine_refused"

    def __init__(self, exc: LegFailed) -> None:
        super().__init__(exc.detail or exc.message)


class ContextTooLong(ClientError):
    """The prompt, with the answer asked for, does not fit the target model's context (the
    target engine would refuse it the same way)."""

    default_code = "context_length_exceeded"


class PassThrough(Exception):
    """Serve the request from the target pool unchanged; ``reason`` is a metrics path label."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Answer:
    prompt: tuple[int, ...]
    limit: int  # most answer tokens (the client's max_tokens, else the context left)
    tokens: list[int] = field(default_factory=list)
    from_draft: int = 0
    finish: str | None = None

    @property
    def remaining(self) -> int:
        return self.limit - len(self.tokens)

    def context(self, *more: int) -> list[int]:
        return [*self.prompt, *self.tokens, *more]

    def take(self, step: Step) -> None:
        self.tokens.extend(step.tokens)
        self.from_draft += step.from_draft
        self.finish = step.finish if step.finish else ("length" if self.remaining <= 0 else None)

    def text_ids(self) -> list[int]:
        """The ids whose text the client sees: all but a final stop token."""
        return self.tokens[:-1] if self.finish == "stop" else self.tokens


class SpecAnswer:
    def __init__(self, ctx: ShellContext, request: web.Request, job: Job, *, inbound: Inbound,
                 plan: Drafting, priority: Priority, metrics: SpecFirstMetrics) -> None:
        self.ctx, self.request, self.job, self.inbound = ctx, request, job, inbound
        self.plan, self.alias, self.priority = plan, plan.state.alias, priority
        self.metrics = metrics
        self.sf_tenant = ctx.metrics.tenant_labels(plan.key[0])
        body = inbound.body
        self.temperature = float(body.get("temperature") or 0.0) if plan.sampled else 0.0
        self.extra = {pool: self._carried(pool) for pool in (self.alias.draft, self.alias.target)}
        self.rng = random.Random(body.get("seed") if isinstance(body.get("seed"), int) else None)
        self.detok = Detok()
        self.shape = self._shape()
        self.response: web.StreamResponse | None = None
        self.cut = False
        self._open: asyncio.Future[Leg | None] | None = None  # the round under way

    def _carried(self, pool: str) -> dict[str, Any]:
        """What every call to ``pool`` carries of the client's body: its sampling fields, the
        pool's cache salt (the tenant's keyed one where the pool isolates tenants, else the
        client's own) and the pool's priority (only where it schedules by priority)."""
        body, cfg = self.inbound.body, self.ctx.cfg.pool(pool)
        out = {k: body[k] for k in _SAMPLING if k in body}
        client = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        mode = cfg.isolation if cfg is not None else "none"
        salt = self.ctx.salts.salting(mode, self.job.tenant or "", client).salt
        if (salt or client) is not None:
            out["cache_salt"] = salt if salt is not None else client
        if cfg is not None and cfg.priority_scheduling:
            out["priority"] = engine_priority(self.priority)
        return out

    # -- legs ---------------------------------------------------------------------------------

    def _legs(self, pool: str, *, shed: bool) -> list[Leg]:
        """Admitted engines of ``pool`` in routing order; ``shed``: refusal is the request's."""
        ctx, now = self.ctx, self.ctx.clock()
        views = ctx.fleet.views(pool, now)
        decision = ctx.admission.decide(pool, self.priority, views, len(self.inbound.prompt_text)
                                        / 4 + ctx.fleet.estimate(pool).expected(None))
        if not isinstance(decision, Admit):
            if not shed:
                raise PassThrough("draft_shed")
            raise NoCapacity(f"{pool} pool is overloaded for {self.priority.value} requests "
                             f"({decision.reason})", reason=decision.reason,
                             retry_after_s=decision.retry_after_s)
        eligible = [v for v in ctx.admission.eligible(self.priority, views, 0.0) if v.routable]
        ranked = self._rank(pool, eligible)
        if not ranked:
            if not shed:
                raise PassThrough("draft_shed")
            raise NoEngine(pool, reason="no_engine", retry_after_s=ctx.cfg.admission.retry_after_s)
        cfg = ctx.cfg.pool(pool)
        model = cfg.model if cfg is not None else ""
        headers = request_headers(self.request.headers, self.job.request_id)
        timeout = self.alias.leg_timeout_s
        live = [e for e in map(ctx.fleet.live, ranked) if e is not None][:2]
        if not live:  # every ranked engine left the fleet since the views were taken
            raise NoEngine(pool, reason="no_engine", retry_after_s=ctx.cfg.admission.retry_after_s)
        return [Leg(ctx, engine, model, headers, timeout) for engine in live]

    def _rank(self, pool: str, views: list[EngineView]) -> tuple[str, ...]:
        """The pool's own routing policy on the prompt's prefix chain: a conversation's next
        turn finds the engines that hold its beginning."""
        routing = self.ctx.cfg.routing
        chain = prefix_chain(self.inbound.prompt_text, model=pool, tenant=self.plan.key[0],
                             block_chars=routing.block_chars, max_blocks=routing.max_blocks)
        key = RouteKey(chain=chain, tenant=self.plan.key[0], model=pool)
        policy = self.ctx.policies[pool]
        ranked = policy.rank(key, views)
        if ranked:
            policy.observe(key, ranked[0])
        return ranked

    # -- the answer -----------------------------------------------------------------------------

    async def run(self) -> web.StreamResponse:
        try:
            return await self._run()
        except LegFailed as exc:
            if self.response is None and exc.client_fault:
                raise EngineRefused(exc) from None
            return await self._fail(exc)
        except KvproxyError as exc:
            return await self._fail(exc)
        except ConnectionError:
            if self.response is None:
                raise
            self.job.status = CLIENT_CLOSED  # the client left while its stream was written
            return self.response

    async def _run(self) -> web.StreamResponse:
        targets = self._legs(self.alias.target, shed=True)
        drafts = self._legs(self.alias.draft, shed=False)
        self.job.engine = targets[0].name
        answer = await self._start(targets)
        self.metrics.requests.labels(self.alias.name, "speculative").inc()
        draft: Leg | None = drafts[0]
        with self.ctx.drain.cuttable(self._cut):
            while answer.finish is None and not self.cut:
                # Each round is a task of its own, so that the drain's cut ends one waiting on an
                # engine call now, not at the call's timeout (past the proxy's exit).
                self._open = asyncio.ensure_future(self._step(answer, draft, targets))
                try:
                    draft = await self._open
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if not self.cut or (task is not None and task.cancelling()):
                        raise  # the client left (or a deadline): not the drain's cut
                finally:
                    self._open = None
            try:
                return await self._finish(answer, targets[0])
            except UpstreamError as exc:
                if getattr(exc, "client_fault", False) or len(targets) < 2 or self.cut:
                    raise
                targets.pop(0)
                self.job.engine = targets[0].name
                return await self._finish(answer, targets[0])

    async def _step(self, answer: Answer, draft: Leg | None, targets: list[Leg]) -> Leg | None:
        """One round and its text to the client; the draft leg for the next round."""
        try:
            draft = await self._round(answer, draft, targets)
            await self._emit(answer, targets[0])
        except UpstreamError as exc:
            # A target that failed, or answered what cannot be used (a malformed verification):
            # the verified prefix is here, so the next engine goes on from it, once. A refusal of
            # the request itself would be refused there too.
            if getattr(exc, "client_fault", False) or len(targets) < 2:
                raise
            targets.pop(0)
            self.job.engine = targets[0].name
        return draft

    async def _start(self, targets: list[Leg]) -> Answer:
        body = self.inbound.body
        if self.inbound.endpoint is Endpoint.CHAT:
            render: dict[str, Any] = {"messages": body["messages"], "add_generation_prompt": True}
        elif isinstance(body.get("prompt"), list) and all(isinstance(t, int)
                                                          for t in body["prompt"]):
            render = {}
            prompt = tuple(body["prompt"])
        else:
            render = {"prompt": body["prompt"]}
        if render:
            data = await targets[0].post("/tokenize", render)
            prompt = speclegs._ids(data.get("tokens"), targets[0].name)
            context = data.get("max_model_len")
        else:
            context = None
        if len(prompt) > self.alias.max_prompt_tokens:
            raise PassThrough("prompt_too_long")
        left = int(context) - len(prompt) if isinstance(context, int) else None
        if left is not None and left < 1:
            raise ContextTooLong(f"the prompt's {len(prompt)} tokens fill the model's context of "
                                 f"{context} tokens")
        if self.job.max_tokens is not None and left is not None and self.job.max_tokens > left:
            raise ContextTooLong(f"max_tokens is {self.job.max_tokens}, but the prompt's "
                                 f"{len(prompt)} tokens leave {left} of the model's context of "
                                 f"{context} tokens")
        limit = self.job.max_tokens or (left if left is not None else 4096)
        return Answer(prompt, max(1, limit))

    async def _round(self, answer: Answer, draft: Leg | None, targets: list[Leg]) -> Leg | None:
        target = targets[0]
        if draft is None:
            await self._target_only(answer, target)
            return None
        n = min(self.plan.state.history.chunk(self.plan.key), answer.remaining)
        top_k = APPROX_TOP_K if self.temperature > 0 else 0
        gate = self.plan.gate
        try:
            with gate.drafting(target.name, n):
                drafted = await speclegs.draft(draft, answer.context(), n,
                                               temperature=self.temperature,
                                               extra=self.extra[self.alias.draft], top_k=top_k)
        except LegFailed:
            self.metrics.draft_failures.labels(self.alias.name).inc()
            return None
        await gate.ready(target.name, self.alias.verify_window_s)
        checked = await self._verify(target, answer.context(*drafted.tokens),
                                     len(drafted.tokens), top_k or 1)
        verdict = (verify_sampled(drafted.tokens, drafted.entries, checked.entries,
                                  self.temperature, self.rng) if top_k
                   else verify_greedy(drafted.tokens, checked.entries))
        self._record(len(drafted.tokens), verdict.accepted, verdict.correction is not None)
        rnd = Round(drafted.tokens, drafted.finish, verdict, checked.bonus, checked.bonus_finish)
        await self._apply(answer, advance(rnd, self.plan.state.facts, answer.remaining), target)
        return draft

    async def _verify(self, target: Leg, ids: list[int], n: int, top_k: int) -> Verified:
        """Verify reading the target's prefix cache where it can; else recompute the context."""
        state, count = self.plan.state, self.metrics.verifications
        kw: dict[str, Any] = {"temperature": self.temperature,
                              "extra": self.extra[self.alias.target], "top_k": top_k}
        if self.alias.verify == "cached" and state.cached_verify is not False:
            try:
                got = await speclegs.verify_cached(target, ids, n, **kw)
            except speclegs.NoCachedVerify as exc:
                state.cached_verify = False
                log.warning("speculative-first alias %s: the target pool does not serve "
                            "cache-reading verification (%s); every round recomputes the "
                            "context", self.alias.name, exc)
            else:
                state.cached_verify = True
                count.labels(self.alias.name, "cached" if got else "redone").inc()
                if got is not None:
                    return got
        count.labels(self.alias.name, "recomputed").inc()
        return await speclegs.verify(target, ids, n, **kw)

    async def _apply(self, answer: Answer, step: Step, target: Leg) -> None:
        if step.ask is not None:
            self.metrics.role_checks.labels(self.alias.name).inc()
            stopped = await speclegs.stops_on(target, answer.context(*step.tokens), step.ask,
                                              self.extra[self.alias.target])
            self.plan.state.facts.learn(step.ask, stopped=stopped)
            step = settle(step, stopped=stopped, remaining=answer.remaining)
        answer.take(step)

    async def _target_only(self, answer: Answer, target: Leg) -> None:
        n = min(TARGET_ONLY_CHUNK, answer.remaining)
        body = {"prompt": answer.context(), "max_tokens": n, "return_token_ids": True,
                "temperature": self.temperature, "stream": False,
                **self.extra[self.alias.target]}
        choice = speclegs._choice(await target.post("/v1/completions", body), target.name)
        tokens = speclegs._ids(choice.get("token_ids"), target.name)
        stopped = choice.get("finish_reason") == "stop" and choice.get("stop_reason") is None
        if tokens:
            self.plan.state.facts.learn(tokens[-1], stopped=stopped)
        answer.take(Step(tokens, 0, "stop" if stopped else None))

    def _record(self, drafted: int, accepted: int, mismatched: bool) -> None:
        state, key, sf = self.plan.state, self.plan.key, self.metrics
        sf.drafted.labels(self.alias.name, self.sf_tenant).inc(drafted)
        if state.history.record(key, accepted, mismatched, self.ctx.clock()):
            sf.fallbacks.labels(self.alias.name, self.sf_tenant).inc()
        agreement = state.history.agreement(key)
        if agreement is not None:
            sf.agreement.labels(self.alias.name, self.sf_tenant).set(agreement)

    # -- output ---------------------------------------------------------------------------------

    def _shape(self) -> Shape:
        chat = self.inbound.endpoint is Endpoint.CHAT
        prefix = "chatcmpl-" if chat else "cmpl-"
        # The target's model, as a pass-through answer from the same alias names it (vLLM writes
        # the model it served there): who answered does not change what the answer says.
        model = upstream_model(self.ctx.cfg, self.alias.target, self.inbound.model)
        return Shape(chat, prefix + uuid.uuid4().hex, int(time.time()), model)

    def _headers(self, answer: Answer | None) -> dict[str, str]:
        out = self.job.client_headers() | {"X-Speculative": "draft-first"}
        if answer is not None:
            out["X-Draft-Tokens"] = str(answer.from_draft)
            out["X-Target-Tokens"] = str(len(answer.tokens) - answer.from_draft)
        return out

    async def _emit(self, answer: Answer, target: Leg) -> None:
        if not self.job.stream or answer.finish is not None:
            return
        text = self.detok.delta(await speclegs.detokenize(target, answer.text_ids()))
        if text:
            await self._write(text_chunk(self.shape, text, None))

    async def _write(self, data: bytes) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers=self._headers(None) | {
                "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
            await self.response.prepare(self.request)
            self.job.first_byte_at = self.ctx.clock()
            self.job.status = 200
            if self.shape.chat:
                await self.response.write(role_chunk(self.shape))
        await self.response.write(data)

    async def _finish(self, answer: Answer, target: Leg) -> web.StreamResponse:
        if self.cut:
            # As the relay ends a stream cut at the drain timeout.
            return await self._fail(NoCapacity(
                "the proxy is shutting down; the answer is incomplete", reason="draining"))
        self._account(answer)
        text = visible(await speclegs.detokenize(target, answer.text_ids()))
        finish = answer.finish or "length"
        shape, prompt, done = self.shape, len(answer.prompt), len(answer.tokens)
        if not self.job.stream:
            self.job.status, self.job.first_byte_at = 200, self.ctx.clock()
            body = whole(shape, text, finish, prompt, done)
            return web.Response(body=body, content_type="application/json",
                                headers=self._headers(answer))
        await self._write(text_chunk(shape, self.detok.delta(text), finish))
        if asks_for_usage(self.inbound.body):
            await self._write(usage_chunk(shape, prompt, done))
        who = f"draft_tokens={answer.from_draft} target_tokens={done - answer.from_draft}"
        await self._write(b": kvproxy " + who.encode() + b"\n\n" + DONE)
        assert self.response is not None
        await self.response.write_eof()
        self.job.delivered = True
        return self.response

    def _account(self, answer: Answer) -> None:
        done = len(answer.tokens)
        self.job.usage = Usage(len(answer.prompt), done)
        sf = self.metrics
        sf.tokens.labels(self.alias.name, self.sf_tenant, "draft").inc(answer.from_draft)
        sf.tokens.labels(self.alias.name, self.sf_tenant, "target").inc(done - answer.from_draft)

    async def _fail(self, exc: KvproxyError) -> web.StreamResponse:
        """Before the first byte: the error itself; after: one SSE error event, no ``[DONE]``."""
        if self.response is None:
            raise exc
        return await self.fail_stream(exc)

    async def fail_stream(self, exc: KvproxyError) -> web.StreamResponse:
        assert self.response is not None
        self.job.status = exc.status
        with contextlib.suppress(ConnectionError):
            await self.response.write(error_event(exc.message, exc.err_type))
            await self.response.write_eof()
        return self.response

    def _cut(self) -> None:
        self.cut = True
        if self._open is not None:
            self._open.cancel()


async def serve(ctx: ShellContext, request: web.Request, job: Job, *, inbound: Inbound,
                plan: Drafting, priority: Priority, metrics: SpecFirstMetrics
                ) -> web.StreamResponse:
    """Answer ``inbound`` speculatively (``PassThrough`` before any byte: serve it normally)."""
    answer = SpecAnswer(ctx, request, job, inbound=inbound, plan=plan, priority=priority,
                        metrics=metrics)
    if job.deadline is None:
        return await answer.run()
    try:
        async with asyncio.timeout_at(job.deadline):
            return await answer.run()
    except TimeoutError:
        error = UpstreamTimeout(f"the request's deadline of {job.timeout_s:g} s passed before "
                                "the answer was complete")
        if answer.response is None:
            raise error from None
        return await answer.fail_stream(error)


__all__: Sequence[str] = ("PassThrough", "SpecAnswer", "serve")
