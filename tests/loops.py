"""Event loops for the tiers that run the proxy's relay and telemetry in-process: uvloop, the loop
``kvproxy serve`` runs on, so that a path that behaves differently there (transports,
``set_protocol``, timers) is tested as it ships; and asyncio's own loop, on which the proxy's code
must work as well. A tier opts in from its ``conftest.py`` (``pytest_asyncio_loop_factories``);
the contract tier shares session-scoped engines on one session loop and does not."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import uvloop

Factories = Mapping[str, Callable[[], asyncio.AbstractEventLoop]]

SHIPPED: Factories = {"uvloop": uvloop.new_event_loop}
BOTH: Factories = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
