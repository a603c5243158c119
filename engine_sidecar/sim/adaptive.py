"""Adaptive speculation for simulated engines: the controller's engine handle, step-cost model
and the admin routes that restart an engine with a new schedule over HTTP.

Rules:
- The handle performs what the vLLM sidecar performs for a real engine, on a ``SimEngine`` in
  the same process: read its ``/metrics`` text, and reconfigure it (drain, restart, reopen).
- The controller's step-cost model for a simulated engine comes from its GPU profile, at the
  context length the engine's requests typically hold (``context_tokens``), until measured.
- ``POST /admin/speculation`` validates a schedule before anything restarts (400 naming the
  problem) and answers 202 while the restart runs in a task the engine owns; ``GET`` shows state.
  It takes the pool lease the controllers use (one per cluster: ``SimCluster.spec_lease``) under
  its own holder name, so a restart asked for by hand and the controllers' rollouts together
  keep at most ``max_out`` engines out; 409 while the engine drains or restarts or the lease is
  taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import orjson
from aiohttp import web

from engine_sidecar.sim.engine import ReconfigureRefused, SimEngine
from engine_sidecar.sim.profiles import Profile
from engine_sidecar.speculation import schedule as sch
from engine_sidecar.speculation.controller import (
    Controller,
    ControllerSettings,
    ReconfigureAbandoned,
    ReconfigureFailed,
)
from engine_sidecar.speculation.cost import StepCost
from engine_sidecar.speculation.lease import Lease, LocalLease
from engine_sidecar.speculation.policy import PolicySettings

log = logging.getLogger(__name__)


class SimEngineHandle:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def current_schedule(self) -> sch.Schedule:
        eng = self.engine
        if eng.schedule is not None:
            return eng.schedule
        return sch.uniform(eng.config.num_speculative_tokens, eng.config.max_num_seqs)

    async def metrics_text(self) -> str | None:
        return None if self.engine.restarting else self.engine.metrics_text()

    async def reconfigure(self, schedule: sch.Schedule, on_drained: Callable[[], None]
                          ) -> None:
        try:
            await self.engine.reconfigure(schedule, on_drained=on_drained)
        except ReconfigureRefused as exc:
            raise ReconfigureAbandoned(str(exc)) from None
        except RuntimeError as exc:
            raise ReconfigureFailed(str(exc)) from None


def step_cost(profile: Profile, context_tokens: int = 1024) -> StepCost:
    """The controller's cost model fitted to a simulator profile (see speculation/cost.py)."""
    bw, fl = profile.bandwidth * profile.mbu, profile.peak_flops * profile.mfu
    per_token_flops = 2.0 * profile.params + 4.0 * profile.layers * profile.q_heads \
        * profile.head_dim * context_tokens
    weights = profile.weight_bytes / bw
    return StepCost(fixed_s=profile.t_fixed, weights_s=weights,
                    kv_per_seq_s=profile.kv_bytes_per_token * context_tokens / bw,
                    compute_per_token_s=per_token_flops / fl,
                    draft_pass_s=profile.draft_fraction * weights)


def attach_controller(engine: SimEngine, settings: ControllerSettings, lease: Lease, *,
                      context_tokens: int = 1024) -> Controller:
    """A controller for ``engine`` whose series join the engine's ``/metrics``."""
    controller = Controller(engine.name, SimEngineHandle(engine), settings, lease,
                            cost=step_cost(engine.profile, context_tokens),
                            pool_waiting=None)
    engine.extra_metrics.append(controller.metrics_text)
    return controller


def default_settings(engine: SimEngine) -> ControllerSettings:
    cfg = engine.config
    return ControllerSettings(policy=PolicySettings(max_k=cfg.num_speculative_tokens,
                                                    max_batch=cfg.max_num_seqs))


async def run_controllers(engines: list[SimEngine], lease: Lease | None = None) -> None:
    """Run one controller per speculating engine, sharing one pool lease (the cluster's, which
    the admin route takes too), until cancelled."""
    lease = lease or LocalLease()
    controllers = [attach_controller(e, default_settings(e), lease)
                   for e in engines if e.config.num_speculative_tokens > 0]
    async with asyncio.TaskGroup() as group:
        for c in controllers:
            group.create_task(c.run(), name=f"sim-speculation-controller:{c.name}")


# -- admin routes ----------------------------------------------------------------------------

_TASKS: web.AppKey[set[asyncio.Task[None]]] = web.AppKey("speculation_tasks")
_SIM: web.AppKey[SimEngine] = web.AppKey("speculation_engine", SimEngine)
_LEASE: web.AppKey[Lease] = web.AppKey("speculation_lease")


def add_routes(app: web.Application, engine: SimEngine, lease: Lease) -> None:
    app[_TASKS] = set()
    app[_SIM] = engine
    app[_LEASE] = lease
    app.router.add_get("/admin/speculation", _get)
    app.router.add_post("/admin/speculation", _post)
    app.on_cleanup.append(_cancel_tasks)


def _state(engine: SimEngine) -> dict[str, object]:
    handle = SimEngineHandle(engine)
    return {"num_speculative_tokens": engine.config.num_speculative_tokens,
            sch.SCHEDULE_FIELD: sch.to_json(handle.current_schedule()),
            "draining": engine.draining, "restarting": engine.restarting,
            "restarts": engine.restarts}


def _engine(request: web.Request) -> SimEngine:
    return request.app[_SIM]


async def _get(request: web.Request) -> web.Response:
    return web.json_response(_state(_engine(request)))


async def _post(request: web.Request) -> web.Response:
    engine = _engine(request)
    try:
        body = orjson.loads(await request.read())
        raw = body[sch.SCHEDULE_FIELD] if isinstance(body, dict) else None
        schedule = sch.validate(raw, max_k=engine.config.num_speculative_tokens)
    except (orjson.JSONDecodeError, KeyError):
        return _error(f"expected a JSON object with {sch.SCHEDULE_FIELD}")
    except sch.ScheduleError as exc:
        return _error(str(exc))
    # A restart asked for a moment ago has not set ``draining`` yet (its task has not run): the
    # tasks still running count too, or two requests would restart the engine twice over.
    if engine.draining or engine.restarting or request.app[_TASKS]:
        return _error("the engine is already draining or restarting", status=409)
    # Its own holder: the engine's controller (holder ``engine.name``) must not count it as its
    # own lease and restart the engine beside it.
    lease, holder = request.app[_LEASE], f"admin:{engine.name}"
    if not await lease.acquire(holder):
        return _error("another engine of the pool is being reconfigured", status=409)
    task = asyncio.create_task(_restart(engine, schedule, lease, holder),
                               name=f"sim-restart:{engine.name}")
    request.app[_TASKS].add(task)
    task.add_done_callback(request.app[_TASKS].discard)
    return web.json_response(_state(engine) | {"draining": True}, status=202)


async def _restart(engine: SimEngine, schedule: sch.Schedule, lease: Lease, holder: str
                   ) -> None:
    try:
        await engine.reconfigure(schedule)
    except RuntimeError as exc:
        log.error("restart of %s with %s failed: %s", engine.name, sch.render(schedule), exc)
    finally:
        await lease.release(holder)


def _error(message: str, status: int = 400) -> web.Response:
    kind = "ConflictError" if status == 409 else "BadRequestError"
    return web.json_response({"error": {"message": message, "type": kind,
                                        "param": sch.SCHEDULE_FIELD, "code": status}},
                             status=status)


async def _cancel_tasks(app: web.Application) -> None:
    tasks: set[asyncio.Task[None]] = app[_TASKS]
    for task in [*tasks]:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
