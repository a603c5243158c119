"""Runs the vLLM server: start, wait for health, warm up, watch, restart with backoff, drain.

Rules:
- The decisions (command line, backoff delays, derived figures) come from the pure modules; this
  module only performs them.
- Every background task is named and owned by :class:`Supervisor`; ``close`` cancels them.
- Ready means: the process runs, ``/health`` answered 200 and every warm-up request succeeded, and
  the sidecar is not draining. Anything else is not ready.
- ``reconfigure`` restarts the engine with another command line (a new speculation schedule):
  report draining, wait for the engine's requests, stop supervision and the engine, start the new
  one and wait for it to be ready; only then is supervision (restart on crash) resumed. A start
  that fails leaves the engine stopped and raises ``StartupFailed`` so the caller rolls back; a
  failed start of the last good command resumes supervision, whose backoff keeps trying.
- A reconfiguration never cuts a request: when requests still run at ``drain_timeout_s`` it is
  abandoned (``Abandoned``), the engine keeps running and serving as before. One runs at a time.
- Stopping (``drain_and_stop``, ``close``) wins over a reconfiguration: it is abandoned at its
  next step and starts no engine afterwards, and ``close`` waits for it to give up before it
  stops the engine, so no engine outlives the sidecar. A drain that interrupts a reconfiguration
  still waiting for requests waits for them as any drain does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from engine_sidecar.vllm import metrics as m
from engine_sidecar.vllm.backoff import Backoff
from engine_sidecar.vllm.process import EngineProcess
from engine_sidecar.vllm.profile import Profile, flatten_args
from engine_sidecar.vllm.spec import SpecStats, SpecWindow

log = logging.getLogger(__name__)
_WARMUP_PROMPT = "Warm up the engine: the quick brown fox jumps over the lazy dog."
# How long ``close`` lets a reconfiguration reach its next step before cancelling it.
_RECONFIGURE_GRACE_S = 10.0


class StartupFailed(Exception):
    """The engine exited or never became healthy during start-up."""


class Abandoned(Exception):
    """A reconfiguration gave up without restarting the engine on the new command line."""


@dataclass
class SupervisorState:
    ready: bool = False
    draining: bool = False
    restarts: int = 0
    process: EngineProcess | None = None
    last_exit: int | None = None
    events: list[str] = field(default_factory=list)

    @property
    def engine_up(self) -> bool:
        return self.process is not None and self.process.returncode is None


class Supervisor:
    def __init__(self, profile: Profile, cmd: Sequence[str], env: Mapping[str, str],
                 session: aiohttp.ClientSession) -> None:
        self.profile = profile
        self.cmd = list(cmd)
        self.env = dict(env)
        self.state = SupervisorState()
        self._session = session
        side = profile.sidecar
        self._backoff = Backoff(side.restart_initial_s, side.restart_max_s,
                                side.restart_reset_after_s)
        self._window = SpecWindow(side.spec_window_s)
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._supervision: asyncio.Task[None] | None = None
        self._good = (profile, list(cmd))
        # The reconfiguration running (its task, and whether it still waits for requests).
        self._reconfiguring: asyncio.Task[Any] | None = None
        self._reconfigure_draining = False
        self._reconfigured = asyncio.Event()
        self._reconfigured.set()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._supervise(self._run_forever())
        if self.profile.engine.num_speculative_tokens > 0:
            self._tasks.append(asyncio.create_task(self._poll_spec(), name="vllm-spec-poller"))

    def _supervise(self, coro: Coroutine[Any, Any, None]) -> None:
        self._supervision = asyncio.create_task(coro, name="vllm-supervisor")
        self._tasks = [t for t in self._tasks if not t.done()] + [self._supervision]

    async def close(self) -> None:
        self._stopping.set()
        await self._reconfiguration_over()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._stop_engine()

    async def drain_and_stop(self) -> None:
        """Report draining, wait for the engine's requests to finish (bounded), then stop it."""
        # An engine that never became ready has served nobody: nothing to wait for. One that a
        # reconfiguration was draining has.
        was_ready = self.state.ready or self._reconfigure_draining
        self.state.ready, self.state.draining = False, True
        self._stopping.set()  # a reconfiguration gives up at its next step
        now = time.monotonic()
        deadline = now + self.profile.sidecar.drain_timeout_s
        # Even an idle engine keeps running until the proxies have had time to see the flag:
        # a request routed here in the meantime must still be served.
        noticed_at = now + self.profile.sidecar.drain_notice_s
        while was_ready and self.state.engine_up and time.monotonic() < deadline:
            busy = await self._in_flight()
            if busy is not None and busy <= 0 and time.monotonic() >= noticed_at:
                break
            await asyncio.sleep(0.25)
        await self.close()

    # -- reconfiguration ---------------------------------------------------------------------

    async def reconfigure(self, profile: Profile, cmd: Sequence[str],
                          on_drained: Callable[[], None] | None = None) -> None:
        """Drain, restart with ``cmd``, wait until ready (see module rules)."""
        self._check_stopping()
        if not self._reconfigured.is_set():
            raise Abandoned("another reconfiguration of this engine is in progress")
        self._reconfigured.clear()
        self._reconfiguring = asyncio.current_task()
        try:
            await self._drain_for_reconfigure()
            if on_drained is not None:
                on_drained()
            await self._restart_with(profile, cmd)
        finally:
            self._reconfiguring, self._reconfigure_draining = None, False
            self._reconfigured.set()

    def _check_stopping(self) -> None:
        if self._stopping.is_set():
            raise Abandoned("the sidecar is stopping")

    async def _drain_for_reconfigure(self) -> None:
        was_ready = self.state.ready
        self.state.draining, self.state.ready = True, False
        self._reconfigure_draining = True
        self._note("draining to reconfigure")
        try:
            await self._wait_idle()
        except Abandoned:
            if not self._stopping.is_set():  # back in service, as it was; supervision never left
                self.state.draining, self.state.ready = False, was_ready and self.state.engine_up
                self._note("reconfiguration abandoned: requests still running")
            raise
        self._reconfigure_draining = False

    async def _restart_with(self, profile: Profile, cmd: Sequence[str]) -> None:
        await self._stop_supervision()
        await self._stop_engine()
        self._check_stopping()
        self.profile, self.cmd = profile, list(cmd)
        try:
            proc = await self._start_ready()
            self._check_stopping()  # ``close`` stops the engine just started
        except (StartupFailed, OSError) as exc:
            self._check_stopping()
            await self._stop_engine()
            if self.cmd == self._good[1]:
                self.state.draining = False
                self._supervise(self._run_forever())
            raise StartupFailed(str(exc)) from exc
        self._good = (profile, list(cmd))
        self.state.draining, self.state.ready = False, True
        self._note(f"ready after reconfiguration (pid {proc.pid})")
        self._supervise(self._watch_then_supervise(proc))

    async def _wait_idle(self) -> None:
        """Until the engine has no request (after the drain notice); ``Abandoned`` when it still
        has some at ``drain_timeout_s``, or the sidecar is stopping."""
        side = self.profile.sidecar
        now = time.monotonic()
        deadline, noticed_at = now + side.drain_timeout_s, now + side.drain_notice_s
        while self.state.engine_up:
            self._check_stopping()
            busy = await self._in_flight()
            if busy is not None and busy <= 0 and time.monotonic() >= noticed_at:
                return
            if time.monotonic() >= deadline:
                still = "an unknown number of" if busy is None else f"{busy:.0f}"
                raise Abandoned(f"the drain did not end within {side.drain_timeout_s:g} s "
                                f"({still} requests still running); the engine keeps its "
                                "schedule")
            await asyncio.sleep(0.25)

    async def _reconfiguration_over(self) -> None:
        """Wait for a running reconfiguration to give up (it checks ``_stopping`` at each
        step); cancel it if it does not within the grace period."""
        task = self._reconfiguring
        if task is None or task is asyncio.current_task():
            return
        try:
            await asyncio.wait_for(self._reconfigured.wait(), _RECONFIGURE_GRACE_S)
        except TimeoutError:
            log.warning("a reconfiguration did not give up in %.0f s; cancelling it",
                        _RECONFIGURE_GRACE_S)
            task.cancel()
            await self._reconfigured.wait()

    async def _stop_supervision(self) -> None:
        task, self._supervision = self._supervision, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _start_ready(self) -> EngineProcess:
        log.info("starting vLLM: %s", flatten_args(self.cmd))
        proc = await EngineProcess.start(self.cmd, self.env)
        self.state.process = proc
        await self._wait_healthy(proc)
        await self._warm_up()
        return proc

    async def _watch_then_supervise(self, proc: EngineProcess) -> None:
        status = await proc.wait()
        self.state.ready, self.state.last_exit = False, status
        self._note(f"vLLM pid {proc.pid} exited with status {status}")
        await self._stop_engine()
        if not self._stopping.is_set() and not self.state.draining:
            self.state.restarts += 1
            await self._run_forever()

    async def _stop_engine(self) -> None:
        proc, self.state.ready = self.state.process, False
        if proc is not None:
            self.state.last_exit = await proc.stop(self.profile.sidecar.stop_timeout_s)
            log.info("vLLM pid=%d stopped (status %s)", proc.pid, self.state.last_exit)

    # -- supervision -------------------------------------------------------------------------

    async def _run_forever(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                await self._run_once()
            except (StartupFailed, OSError) as exc:
                # OSError: the interpreter or vLLM could not be executed at all.
                log.error("vLLM start-up failed: %s", exc)
            await self._stop_engine()
            if self._stopping.is_set() or self.state.draining:
                return
            delay = self._backoff.next_delay(time.monotonic() - started)
            self.state.restarts += 1
            self._note(f"restart {self.state.restarts} in {delay:.1f} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _run_once(self) -> None:
        log.info("starting vLLM: %s", flatten_args(self.cmd))
        proc = await EngineProcess.start(self.cmd, self.env)
        self.state.process = proc
        await self._wait_healthy(proc)
        await self._warm_up()
        if not self.state.draining:
            self.state.ready = True
            self._note(f"ready (pid {proc.pid})")
        status = await proc.wait()
        self.state.ready = False
        self.state.last_exit = status
        self._note(f"vLLM pid {proc.pid} exited with status {status}")

    async def _wait_healthy(self, proc: EngineProcess) -> None:
        side = self.profile.sidecar
        deadline = time.monotonic() + side.startup_timeout_s
        while time.monotonic() < deadline:
            if self._stopping.is_set():
                raise StartupFailed("the sidecar is stopping")
            if proc.returncode is not None:
                raise StartupFailed(f"exited with status {proc.returncode} before /health")
            if await self._get_status("/health") == 200:
                return
            await asyncio.sleep(side.health_interval_s)
        raise StartupFailed(f"no healthy /health within {side.startup_timeout_s:.0f} s")

    async def _warm_up(self) -> None:
        """The first requests after load are slow (kernels compile, caches fill): take them
        ourselves so the first client does not."""
        side, eng = self.profile.sidecar, self.profile.engine
        body = {"model": eng.served_model_name, "prompt": _WARMUP_PROMPT,
                "max_tokens": side.warmup_max_tokens, "temperature": 0.0}
        url = self.profile.local_engine_url + "/v1/completions"
        for i in range(side.warmup_requests):
            if self._stopping.is_set():
                raise StartupFailed("the sidecar is stopping")
            try:
                async with self._session.post(url, json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise StartupFailed(f"warm-up request {i + 1} answered {resp.status}")
            except aiohttp.ClientError as exc:
                raise StartupFailed(f"warm-up request {i + 1} failed: {exc}") from exc

    def _note(self, event: str) -> None:
        log.info("%s", event)
        self.state.events = [*self.state.events[-19:], event]

    # -- engine metrics ----------------------------------------------------------------------

    async def _get_status(self, path: str) -> int | None:
        try:
            async with self._session.get(self.profile.local_engine_url + path,
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def engine_metrics(self) -> str | None:
        """vLLM's /metrics text, or ``None`` while it cannot be had; feeds the spec window."""
        if not self.state.engine_up:
            return None
        try:
            async with self._session.get(self.profile.local_engine_url + "/metrics",
                                         timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return None
        counters = m.spec_counters(list(m.parse_samples(text)))
        if counters is not None:
            self._window.add(time.monotonic(), counters)
        return text

    async def _in_flight(self) -> float | None:
        text = await self.engine_metrics()
        return None if text is None else m.in_flight(list(m.parse_samples(text)))

    async def _poll_spec(self) -> None:
        # The window needs samples even when nobody scrapes the sidecar.
        while True:
            await self.engine_metrics()
            await asyncio.sleep(self.profile.sidecar.spec_poll_s)

    @property
    def last_good(self) -> tuple[Profile, list[str]]:
        return self._good

    def spec_stats(self) -> SpecStats | None:
        k = self.profile.engine.num_speculative_tokens
        if k <= 0:
            return None
        return self._window.stats(num_speculative_tokens=k,
                                  token_cost=self.profile.sidecar.spec_token_cost)

    def sidecar_state(self) -> m.SidecarState:
        s = self.state
        return m.SidecarState(ready=s.ready and not s.draining, draining=s.draining,
                              engine_up=s.engine_up, restarts=s.restarts,
                              num_speculative_tokens=self.profile.engine.num_speculative_tokens)
