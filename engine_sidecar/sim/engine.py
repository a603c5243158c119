"""One simulated engine: the scheduler, the KV cache and the step loop that drives them.

Rules:
- One named asyncio task per engine runs the step loop; a request is not a task. Each step the loop
  asks the scheduler for a plan, sleeps the modelled step time divided by ``time_scale`` (measured
  from the start of the step, so delivery work does not slow the simulated GPU), applies the plan
  and pushes the new tokens to each request's ``RequestStream``, which wakes its reader through a
  single future.
- Aborting (client disconnect) removes the request from the scheduler at once and frees its blocks;
  its id is remembered for ``/admin/state``.
- Latencies fed to the metrics are simulated seconds: wall seconds times ``time_scale``.
- ``reconfigure`` is a restart with a new speculation schedule, as the vLLM sidecar does it:
  refuse new requests (draining), let the running ones finish, start again empty (KV cache,
  counters and histograms reset, as a new vLLM process's would be), stay out ``restart_s``
  simulated seconds, then accept requests again. ``FaultConfig.restart_fails`` makes it fail
  after the drain, leaving the engine on its old schedule. It is not re-entrant: while one runs
  (or the engine drains to stop) another is refused (``ReconfigureRefused``), and so is one whose
  drain does not end in time (the streams still running are not cut); either way the engine
  keeps its schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import random
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine_sidecar.sim import speculation as simspec
from engine_sidecar.sim.agreement import AnswerWords, answer_begun
from engine_sidecar.sim.config import FaultConfig, SimEngineConfig
from engine_sidecar.sim.kvcache import BlockPool
from engine_sidecar.sim.kvpublisher import KvEventPublisher
from engine_sidecar.sim.metrics import EngineReading, LatencyMetrics, render
from engine_sidecar.sim.profiles import PROFILES
from engine_sidecar.sim.scheduler import FinishReason, Scheduler, SimRequest, Status, StepOutput
from engine_sidecar.sim.tokenizer import EOS_INDEX
from engine_sidecar.speculation.schedule import Schedule
from engine_sidecar.vllm.metrics import spec_lines
from engine_sidecar.vllm.spec import SpecCounters, SpecWindow
from proxy.core.blockhash import root_for
from proxy.fleet.tokenizer import load_tokenizer

_ABORTED_KEPT = 1000


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    priority: int = 0
    ignore_eos: bool = False
    cache_salt: str | None = None
    workload: str | None = None  # picks the acceptance class (sim/speculation.py)
    only: int | None = None  # ``allowed_token_ids`` of one token: that word, once
    read_cache: bool = True  # False for prompt_logprobs requests, as vLLM 0.32 does


class RequestStream:
    """The reader's end of one request: words arrive in batches, one future per wait."""

    __slots__ = ("_engine", "_pending", "_waiter", "arrival", "client_id", "finished", "first_at",
                 "last_at", "public_id", "request")

    def __init__(self, engine: SimEngine, request: SimRequest, public_id: str, client_id: str,
                 arrival: float) -> None:
        self._engine = engine
        self.request = request
        self.public_id = public_id
        self.client_id = client_id
        self.arrival = arrival
        self.first_at: float | None = None
        self.last_at = arrival
        self.finished = False
        self._pending: list[int] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, words: list[int], finished: bool) -> None:
        self._pending.extend(words)
        self.finished = finished
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_words(self) -> list[int]:
        """New words since the last call; an empty list means the request has finished."""
        while not self._pending and not self.finished:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        words, self._pending = self._pending, []
        return words

    @property
    def finish_reason(self) -> str:
        return self.request.finish_reason

    @property
    def prompt_tokens(self) -> int:
        return self.request.prompt_len

    @property
    def completion_tokens(self) -> int:
        return len(self.request.output)

    @property
    def cached_tokens(self) -> int:
        return max(0, self.request.num_cached_tokens)

    def abort(self) -> None:
        """Stop generating (the reader went away); a no-op once the request has finished."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self)
            self._wake()


class ReconfigureRefused(RuntimeError):
    """The engine was not restarted and keeps its schedule (see the module rules)."""


class SimEngine:
    def __init__(self, config: SimEngineConfig, name: str | None = None) -> None:
        self.config = config
        self.name = name or config.name or "sim"
        self.model = config.model
        # A copy: configs are values and may be shared by engines; each engine's faults are its own.
        self.faults: FaultConfig = copy.deepcopy(config.faults)
        self.profile = PROFILES[config.profile]
        self.rng = random.Random(config.seed)
        self.fault_rng = random.Random(config.seed + 2)
        self.last_metrics: bytes | None = None
        self.metrics_served = 0  # /metrics answers, failures included: how often it is scraped
        # None: the simulator's own tokenizer (4 bytes per token).
        self.tokenizer = (None if config.tokenizer is None
                          else load_tokenizer(config.tokenizer, "tokenizer"))
        events = config.kv_events.enabled
        self.pool = BlockPool(config.blocks, config.block_size, config.enable_prefix_caching,
                              vllm_hashes=events, record_events=events)
        self.kv_events: KvEventPublisher | None = None
        self.schedule: Schedule | None = config.spec.checked_schedule(
            config.num_speculative_tokens)
        self.scheduler = self._new_scheduler(random.Random(config.seed + 1))
        self.latency = LatencyMetrics()
        self.spec_window = SpecWindow(60.0)
        self.extra_metrics: list[Callable[[], str]] = []
        self.draining = False
        self.restarting = False
        self.restarts = 0
        self.aborted_ids: deque[str] = deque(maxlen=_ABORTED_KEPT)
        self.aborted_client_ids: deque[str] = deque(maxlen=_ABORTED_KEPT)
        self.in_flight = 0
        # Simulated seconds the engine spent running steps (its GPU's busy time), and the steps.
        self.busy_s = 0.0
        self.steps = 0
        self._streams: dict[SimRequest, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._seq = 0
        self._t0 = 0.0

    def _new_scheduler(self, rng: random.Random) -> Scheduler:
        cfg = self.config
        sched = Scheduler(self.pool, max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                          policy=cfg.scheduling_policy, spec_acceptance=cfg.acceptance_per_pos,
                          rng=rng)
        sched.k_lookup = simspec.lookup(self.schedule, cfg.max_num_seqs,
                                        cfg.num_speculative_tokens)
        return sched

    # -- state read by the server, the cluster and tests -----------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def sim_time(self) -> float:
        return (asyncio.get_running_loop().time() - self._t0) * self.config.time_scale

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._t0 = asyncio.get_running_loop().time()
        if self.config.kv_events.enabled:
            self.kv_events = KvEventPublisher(self.config.kv_events, self.name)
            self.kv_events.start()
        self._task = asyncio.create_task(self._run(), name=f"sim-engine-steps:{self.name}")

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.abort()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.kv_events is not None:
            await self.kv_events.close()

    # -- requests --------------------------------------------------------------------------------

    def submit(self, public_id: str, prompt_ids: array[int], sampling: Sampling,
               client_id: str | None = None) -> RequestStream:
        """Queue a request. ``public_id`` is the response id (``chatcmpl-...``), ``client_id`` the
        caller's own id (``X-Request-Id``); both are remembered if the request is aborted."""
        begun = answer_begun(prompt_ids) if sampling.temperature == 0 else 0
        seed = self._word_seed(prompt_ids[:len(prompt_ids) - begun], sampling)
        target, reason = self._target(seed, sampling, begun)
        stop_at = begun + target - 1 if reason == "stop" else None
        words = AnswerWords(seed, agreement=self.agreement(sampling.workload), start=begun,
                            stop_at=stop_at, only=sampling.only)
        if sampling.only is not None:
            target, reason = 1, "stop" if sampling.only == EOS_INDEX else "length"
        self._seq += 1
        req = SimRequest(
            request_id=public_id, token_ids=array("I", prompt_ids), prompt_len=len(prompt_ids),
            target_len=target, finish_reason=reason, priority=sampling.priority, seq=self._seq,
            words=words, root=root_for(sampling.cache_salt), read_cache=sampling.read_cache,
            acceptance=simspec.acceptance_for(
                self.config.spec, self.config.acceptance, sampling.workload, self.sim_time(),
                self.config.num_speculative_tokens) if self.config.num_speculative_tokens else (),
        )
        stream = RequestStream(self, req, public_id, client_id or public_id, self.sim_time())
        self._streams[req] = stream
        self.scheduler.add(req)
        self._wake.set()
        return stream

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` (plus draft lookahead) fits the cache."""
        total = num_tokens + len(self.scheduler.acceptance)
        return -(-total // self.config.block_size) <= self.pool.num_blocks

    def _word_seed(self, prompt_ids: array[int], sampling: Sampling) -> int:
        """Greedy (temperature 0) ignores ``seed``, as in vLLM; a seed fixes a sampled answer."""
        if sampling.temperature == 0:
            key = b"greedy"
        elif sampling.seed is not None:
            key = f"seed={sampling.seed}".encode()
        else:
            return self.rng.getrandbits(64)
        digest = hashlib.blake2b(prompt_ids.tobytes(), digest_size=8, key=key).digest()
        return int.from_bytes(digest, "little")

    def agreement(self, workload: str | None) -> float:
        """How often this engine's greedy words are the target's (1.0 unless it is a draft)."""
        by_class = dict(self.config.draft_agreement_by_workload)
        return by_class.get(workload or "", self.config.draft_agreement)

    def answer_stream(self, prompt_ids: array[int], sampling: Sampling) -> tuple[int, AnswerWords]:
        """For ``prompt_logprobs``: the answer begun at the prompt's end and this engine's words
        from the start of that answer."""
        begun = answer_begun(prompt_ids)
        seed = self._word_seed(prompt_ids[:len(prompt_ids) - begun], replace(sampling,
                               temperature=0.0))
        natural, _ = self._target(seed, replace(sampling, max_tokens=1 << 30), 0)
        return begun, AnswerWords(seed, agreement=self.agreement(sampling.workload),
                                  stop_at=natural - 1)

    def _target(self, seed: int, sampling: Sampling, begun: int = 0
                ) -> tuple[int, FinishReason]:
        """Tokens to generate and why the answer ends; ``begun`` tokens of it are in the prompt
        already (a stop then comes that much sooner, and at once if it is overdue)."""
        low, high = self.config.stop_len_range
        natural = max(1, low + (seed >> 11) % (high - low + 1) - begun)
        # At max_tokens == natural the last token is EOS: vLLM checks for a stop before length.
        if sampling.ignore_eos or sampling.max_tokens < natural:
            return sampling.max_tokens, "length"
        return natural, "stop"

    def abort(self, stream: RequestStream) -> None:
        req = stream.request
        if req.status in (Status.FINISHED, Status.ABORTED):
            return
        self.scheduler.abort(req)
        self._streams.pop(req, None)
        self.aborted_ids.append(stream.public_id)
        self.aborted_client_ids.append(stream.client_id)
        self.latency.finished["abort"] += 1

    # -- restart with a new speculation schedule ---------------------------------------------

    async def reconfigure(self, schedule: Schedule, *, drain_timeout_s: float = 600.0,
                          on_drained: Callable[[], None] | None = None) -> None:
        """Drain, restart empty with ``schedule`` (already validated), reopen; ``RuntimeError``
        if the injected restart fault fired, ``ReconfigureRefused`` if another restart runs or
        the drain timed out (old schedule kept in every case)."""
        if self.draining or self.restarting:
            # A second restart would swap the scheduler under the first's streams, and the
            # first's ``finally`` would reopen the engine in the middle of the second.
            raise ReconfigureRefused("the engine is already draining or restarting")
        self.draining = True
        try:
            await self._drained(drain_timeout_s)
            if on_drained is not None:
                on_drained()
            self.restarting = True
            await asyncio.sleep(self.config.spec.restart_s / self.config.time_scale)
            if self.faults.restart_fails:
                raise RuntimeError("injected fault: the engine failed to restart")
            self.schedule = schedule
            # A restarted engine's cache is empty; subscribers to its KV events are told so.
            self.pool.reset_cache()
            self._publish_kv_events()
            events = self.config.kv_events.enabled
            self.pool = BlockPool(self.config.blocks, self.config.block_size,
                                  self.config.enable_prefix_caching,
                                  vllm_hashes=events, record_events=events)
            self.scheduler = self._new_scheduler(self.scheduler.rng)
            self.latency = LatencyMetrics()
            self.restarts += 1
        finally:
            self.restarting = False
            self.draining = False

    async def _drained(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s / self.config.time_scale
        while self._streams or self.scheduler.has_work:
            if loop.time() >= deadline:
                raise ReconfigureRefused("the drain timed out with requests still running")
            await asyncio.sleep(0.05 / self.config.time_scale)

    # -- the step loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        scale = self.config.time_scale
        while True:
            if not self.scheduler.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            started = loop.time()
            plan = self.scheduler.schedule()
            if not plan.items:
                self._wake.clear()
                await self._wake.wait()
                continue
            dt = self.profile.step_time(plan.batched_tokens, plan.context_tokens,
                                        plan.attn_work, plan.draft_len) / scale
            await asyncio.sleep(max(0.0, started + dt - loop.time()))
            self.busy_s += dt * scale
            self.steps += 1
            self._deliver(self.scheduler.complete(plan))
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """One batch per step, as vLLM publishes them; an empty step publishes nothing."""
        if self.kv_events is not None:
            events = self.pool.take_events()
            if events:
                self.kv_events.publish(events)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``/reset_prefix_cache``: refused while requests hold blocks."""
        done = self.pool.reset_cache()
        self._publish_kv_events()
        return done

    def _deliver(self, outputs: list[StepOutput]) -> None:
        now = self.sim_time()
        latency = self.latency
        for out in outputs:
            stream = self._streams.get(out.request)
            if stream is None:
                continue
            if stream.first_at is None:
                stream.first_at = now
                latency.ttft.observe(now - stream.arrival)
            else:
                latency.itl.observe(now - stream.last_at)
            stream.last_at = now
            if out.finished:
                del self._streams[out.request]
                latency.e2e.observe(now - stream.arrival)
                latency.finished[out.request.finish_reason] += 1
            stream.push(out.new_words, out.finished)

    # -- telemetry -------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        stats = self.scheduler.stats
        counters = {
            "vllm:num_preemptions_total": stats.preemptions,
            "vllm:prompt_tokens_total": stats.prompt_tokens,
            "vllm:generation_tokens_total": stats.generation_tokens,
            "vllm:prefix_cache_queries_total": stats.prefix_queries,
            "vllm:prefix_cache_hits_total": stats.prefix_hits,
            "vllm:spec_decode_num_drafts_total": stats.spec_drafts,
            "vllm:spec_decode_num_draft_tokens_total": stats.spec_draft_tokens,
            "vllm:spec_decode_num_accepted_tokens_total": stats.spec_accepted,
        }
        reading = EngineReading(
            model=self.model, running=self.num_running, waiting=self.num_waiting,
            kv_usage=self.kv_usage, legacy_kv_metric=self.config.legacy_kv_metric,
            block_size=self.config.block_size, num_gpu_blocks=self.pool.num_blocks,
            prefix_caching=self.config.enable_prefix_caching, counters=counters,
            spec_per_pos=stats.spec_accepted_per_pos if self.scheduler.acceptance else None,
            draining=self.draining or self.restarting,
        )
        text = render(reading, self.latency, missing=self.faults.metrics_missing,
                      overrides=self.faults.metric_overrides)
        return text + self._derived_spec() + "".join(extra() for extra in self.extra_metrics)

    def _derived_spec(self) -> str:
        """The vLLM sidecar's ``kvproxy_sidecar_spec_*`` series, from the same window code."""
        k = self.config.num_speculative_tokens
        if k <= 0:
            return ""
        stats = self.scheduler.stats
        self.spec_window.add(self.sim_time(), SpecCounters(
            float(stats.spec_drafts), float(stats.spec_draft_tokens), float(stats.spec_accepted),
            tuple(float(v) for v in stats.spec_accepted_per_pos)))
        derived = self.spec_window.stats(num_speculative_tokens=k,
                                         token_cost=self.profile.draft_fraction)
        return "\n".join(spec_lines(k, derived)) + "\n"

    def state(self) -> dict[str, object]:
        stats = self.scheduler.stats
        return {
            "name": self.name, "model": self.model, "running": self.num_running,
            "waiting": self.num_waiting, "kv_usage": self.kv_usage,
            "num_gpu_blocks": self.pool.num_blocks, "block_size": self.config.block_size,
            "free_blocks": self.pool.num_free, "in_flight": self.in_flight,
            "preemptions": stats.preemptions, "prefix_cache_queries": stats.prefix_queries,
            "prefix_cache_hits": stats.prefix_hits, "draining": self.draining,
            "aborted_ids": list(self.aborted_ids),
            "aborted_request_ids": list(self.aborted_client_ids), "faults": self.faults.as_dict(),
            "kv_events": self.kv_events.state() if self.kv_events is not None else None,
            "busy_s": self.busy_s, "steps": self.steps, "metrics_served": self.metrics_served,
        }
