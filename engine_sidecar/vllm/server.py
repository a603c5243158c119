"""The sidecar's HTTP surface: ``/health``, ``/ready`` and ``/metrics``.

Rules:
- ``/health`` is the sidecar being alive (200 even while the engine restarts or drains).
- ``/ready`` is 200 only when the engine can take requests; its JSON always advertises the engine
  URL, because the proxy sends data to vLLM directly and never through the sidecar.
- ``/metrics`` is vLLM's own exposition followed by the ``kvproxy_sidecar_*`` series; while vLLM is
  down it holds only the sidecar's series (``kvproxy_sidecar_ready 0``), and the adaptive
  speculation loop's series when it runs.
- ``POST /speculation`` (only with the loop on) rolls out a given schedule, validated first.
"""

from __future__ import annotations

from aiohttp import web

from engine_sidecar.speculation.controller import Controller
from engine_sidecar.vllm import adaptive
from engine_sidecar.vllm import metrics as m
from engine_sidecar.vllm.profile import describe
from engine_sidecar.vllm.supervisor import Supervisor

SUPERVISOR = web.AppKey("supervisor", Supervisor)
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    state = sup.sidecar_state()
    body: dict[str, object] = {**describe(sup.profile), "ready": state.ready,
                               "draining": state.draining, "engine_up": state.engine_up,
                               "restarts": state.restarts,
                               "engine_pid": _engine_pid(sup),
                               "events": sup.state.events[-5:],
                               "speculation": adaptive.describe_controller(
                                   request.app.get(adaptive.CONTROLLER))}
    return web.json_response(body, status=200 if state.ready else 503)


def _engine_pid(sup: Supervisor) -> int | None:
    proc = sup.state.process
    return proc.pid if proc is not None and proc.returncode is None else None


async def metrics(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    engine_text = await sup.engine_metrics()
    text = m.combine(engine_text, m.render_derived(sup.sidecar_state(), sup.spec_stats()))
    controller = request.app.get(adaptive.CONTROLLER)
    if controller is not None:
        text += controller.metrics_text()
    return web.Response(body=text.encode(), headers={"Content-Type": _PROMETHEUS_TEXT})


def build_app(supervisor: Supervisor, controller: Controller | None = None) -> web.Application:
    app = web.Application()
    app[SUPERVISOR] = supervisor
    if controller is not None:
        adaptive.add_routes(app, controller)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app
