"""Adaptive speculation for a real vLLM engine: the profile's ``[speculation]`` table, the engine
handle the controller acts through, the pool's shed probe, and the sidecar's ``/speculation``.

Rules:
- Off unless ``speculation.adaptive = true`` and the engine speculates at all. ``act = false``
  keeps the loop observe-only: it decides and exports, never restarts.
- Rolling out needs coordination: a Redis URL (``sidecar.redis_url``; the pool's engines share
  the lease key ``speculation.pool``, by default the engine's role and model), or
  ``coordination = "local"`` for a pool of one. Anything else is refused at start-up.
- The handle restarts vLLM through the supervisor with the profile's command line plus the new
  ``num_speculative_tokens_per_batch_size``; a schedule is validated before anything drains. The
  schedule it reports is the one the engine last came up ready with, not one still starting.
- The pool lease's TTL covers one drain, stop and start, but the lease is renewed while held
  (``lease``): the TTL only bounds how long a crashed sidecar blocks its pool.
- Shedding is read from the proxies' ``/metrics`` (``kvproxy_shed_total``, summed over labels)
  named in ``speculation.proxy_metrics_urls``: any increase since the last look holds a rollout.
  Without proxies configured, only the engine's own queue is consulted.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from engine_sidecar.speculation import schedule as sch
from engine_sidecar.speculation.controller import (
    Controller,
    ControllerSettings,
    ReconfigureAbandoned,
    ReconfigureFailed,
)
from engine_sidecar.speculation.cost import StepCost
from engine_sidecar.speculation.lease import Lease, LocalLease, RedisLease
from engine_sidecar.speculation.policy import DEFAULT_EDGES, PolicySettings
from engine_sidecar.speculation.shift import ShiftSettings
from engine_sidecar.vllm import metrics as m
from engine_sidecar.vllm.profile import Profile, ProfileError, build_command, with_schedule
from engine_sidecar.vllm.supervisor import Abandoned, StartupFailed, Supervisor

log = logging.getLogger(__name__)
SHED_TOTAL = "kvproxy_shed_total"


@dataclass(frozen=True)
class AdaptiveSettings:
    adaptive: bool = False
    act: bool = True
    coordination: str = "redis"  # or "local"
    pool: str = ""
    max_out: int = 1
    margin: float = 0.05
    min_interval_s: float = 300.0
    confirmations: int = 2
    min_drafts: float = 50.0
    probe_k: int = 1
    tie: float = 0.01
    horizon_s: float = 600.0
    restart_cost_s: float = 60.0
    spare_load: float = 0.5
    followup_margin: float = 0.02
    followup_drafts: float = 400.0
    shift_threshold: float = 25.0
    shift_min: float = 0.1
    edges: tuple[int, ...] = DEFAULT_EDGES
    poll_s: float = 5.0
    eval_s: float = 30.0
    window_s: float = 120.0
    max_waiting: float = 16.0
    proxy_metrics_urls: tuple[str, ...] = ()
    step_fixed_s: float = StepCost.fixed_s
    step_weights_s: float = StepCost.weights_s
    step_kv_per_seq_s: float = StepCost.kv_per_seq_s
    step_compute_per_token_s: float = StepCost.compute_per_token_s
    step_draft_pass_s: float = StepCost.draft_pass_s


_LIST_ITEMS: dict[str, type] = {"edges": int, "proxy_metrics_urls": str}


def _coerce(name: str, value: Any, default: Any) -> Any:
    path = f"speculation.{name}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ProfileError(path, "expected a boolean")
        return value
    if isinstance(default, tuple):
        if not isinstance(value, list):
            raise ProfileError(path, "expected a list")
        item = _LIST_ITEMS.get(name)
        if item is not None and not all(type(v) is item for v in value):
            raise ProfileError(path, f"expected a list of {item.__name__}")
        return tuple(value)
    if isinstance(default, float) and isinstance(value, int | float) \
            and not isinstance(value, bool):
        if not math.isfinite(value):  # NaN passes every "> 0" check after this and then fails
            raise ProfileError(path, "must be a finite number")
        return float(value)
    if type(value) is not type(default):
        raise ProfileError(path, f"expected {type(default).__name__}")
    return value


def settings_from(profile: Profile) -> AdaptiveSettings:
    """The ``[speculation]`` table, checked; ``ProfileError`` names the field."""
    known = {f.name: f.default for f in fields(AdaptiveSettings)}
    values: dict[str, Any] = {}
    for key, value in profile.speculation.items():
        if key not in known:
            raise ProfileError(f"speculation.{key}", "unknown field")
        values[key] = _coerce(key, value, known[key])
    settings = AdaptiveSettings(**values)
    if settings.coordination not in ("redis", "local"):
        raise ProfileError("speculation.coordination", "must be 'redis' or 'local'")
    if settings.adaptive and settings.act and settings.coordination == "redis" \
            and not profile.sidecar.redis_url:
        raise ProfileError("speculation.coordination", "rolling out across a pool needs "
                           "sidecar.redis_url (or coordination = \"local\" for a pool of one)")
    try:
        _controller_settings(profile, settings)
    except ValueError as exc:
        raise ProfileError("speculation", str(exc)) from None
    return settings


def _controller_settings(profile: Profile, s: AdaptiveSettings) -> ControllerSettings:
    policy = PolicySettings(
        max_k=max(1, profile.engine.num_speculative_tokens),
        max_batch=profile.engine.max_num_seqs or 256, edges=s.edges, margin=s.margin,
        min_interval_s=s.min_interval_s, confirmations=s.confirmations,
        min_drafts=s.min_drafts, probe_k=s.probe_k, tie=s.tie, horizon_s=s.horizon_s,
        restart_cost_s=s.restart_cost_s, spare_load=s.spare_load,
        followup_margin=s.followup_margin, followup_drafts=s.followup_drafts)
    return ControllerSettings(policy=policy, act=s.act, poll_s=s.poll_s, eval_s=s.eval_s,
                              window_s=s.window_s, max_waiting=s.max_waiting,
                              shift=ShiftSettings(threshold=s.shift_threshold,
                                                  min_shift=s.shift_min))


class VllmEngineHandle:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.python = sup.cmd[0]

    def current_schedule(self) -> sch.Schedule:
        eng = self.sup.last_good[0].engine
        raw = (eng.speculative or {}).get(sch.SCHEDULE_FIELD)
        if raw is None:
            return sch.uniform(eng.num_speculative_tokens, eng.max_num_seqs or 256)
        return sch.validate(raw, max_k=eng.num_speculative_tokens)

    def check(self, schedule: sch.Schedule) -> None:
        sch.validate(sch.to_json(schedule), max_k=self.sup.profile.engine.num_speculative_tokens)

    async def metrics_text(self) -> str | None:
        return await self.sup.engine_metrics() if self.sup.state.ready else None

    async def reconfigure(self, schedule: sch.Schedule, on_drained: Callable[[], None]
                          ) -> None:
        self.check(schedule)
        profile, cmd = self.sup.last_good
        if schedule != self.current_schedule():
            profile = with_schedule(profile, schedule)
            cmd = build_command(profile, self.python)
        # else a rollback: the very command line that last came up, which the supervisor knows
        # as good and keeps restarting if even this start fails (one with the schedule spelled
        # out would be a new command line, and the engine would stay down).
        try:
            await self.sup.reconfigure(profile, cmd, on_drained)
        except StartupFailed as exc:
            raise ReconfigureFailed(str(exc)) from None
        except Abandoned as exc:
            raise ReconfigureAbandoned(str(exc)) from None


def shed_probe(session: aiohttp.ClientSession, urls: tuple[str, ...]
               ) -> Any:
    last: dict[str, float] = {}

    async def probe() -> float | None:
        increase = 0.0
        for url in urls:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    total = m.total(list(m.parse_samples(await resp.text())), SHED_TOTAL) or 0.0
                increase += max(0.0, total - last.get(url, total))
                last[url] = total
        return increase

    return probe


def build(profile: Profile, sup: Supervisor, session: aiohttp.ClientSession
          ) -> tuple[Controller, Lease] | None:
    """The controller for this engine, or ``None`` when the loop is off."""
    s = settings_from(profile)
    if not s.adaptive or profile.engine.num_speculative_tokens <= 0:
        return None
    pool = s.pool or f"{profile.engine.role}:{profile.engine.served_model_name}"
    lease: Lease = LocalLease(s.max_out) if s.coordination == "local" else RedisLease(
        profile.sidecar.redis_url or "", pool, max_out=s.max_out,
        ttl_s=profile.sidecar.startup_timeout_s + profile.sidecar.drain_timeout_s
        + profile.sidecar.stop_timeout_s)
    cost = StepCost(fixed_s=s.step_fixed_s, weights_s=s.step_weights_s,
                    kv_per_seq_s=s.step_kv_per_seq_s,
                    compute_per_token_s=s.step_compute_per_token_s,
                    draft_pass_s=s.step_draft_pass_s)
    controller = Controller(profile.engine_url, VllmEngineHandle(sup),
                            _controller_settings(profile, s), lease, cost=cost,
                            shed_probe=shed_probe(session, s.proxy_metrics_urls)
                            if s.proxy_metrics_urls else None)
    return controller, lease


# -- POST /speculation: roll out a given schedule now (validated first) --------------------------

CONTROLLER = web.AppKey("speculation_controller", Controller)


async def post_schedule(request: web.Request) -> web.Response:
    controller = request.app[CONTROLLER]
    handle = controller.engine
    assert isinstance(handle, VllmEngineHandle)
    try:
        # orjson: bounded nesting (a deep body is a decode error, not a RecursionError) and no
        # integers past 64 bits.
        body = orjson.loads(await request.read())
        raw = body[sch.SCHEDULE_FIELD] if isinstance(body, dict) else None
        schedule = sch.validate(raw, max_k=handle.sup.profile.engine.num_speculative_tokens)
    except (ValueError, KeyError) as exc:
        message = str(exc) if isinstance(exc, sch.ScheduleError) else \
            f"expected a JSON object with {sch.SCHEDULE_FIELD}"
        return web.json_response({"error": {"message": message, "type": "BadRequestError",
                                            "param": sch.SCHEDULE_FIELD, "code": 400}},
                                 status=400)
    done = await controller.apply_now(schedule)
    status = 200 if done else 409
    return web.json_response({"applied": done, sch.SCHEDULE_FIELD: sch.to_json(
        handle.current_schedule()), "reason": controller.last_hold}, status=status)


def add_routes(app: web.Application, controller: Controller) -> None:
    app[CONTROLLER] = controller
    app.router.add_post("/speculation", post_schedule)


def describe_controller(controller: Controller | None) -> Mapping[str, object]:
    if controller is None:
        return {"adaptive": False}
    return {"adaptive": True, "acting": controller.settings.act,
            "rollout": controller.rollout.state.value}
