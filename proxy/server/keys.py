"""Typed keys for the state the async shell keeps on the application and on each request.

Rules: state is reached only through these keys (never string keys), so mypy checks every access.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from proxy.fleet.discovery import ModelDiscovery
from proxy.server.context import ShellContext
from proxy.server.worker import WorkerLink
from proxy.tenancy.shared_routing import SharedRouting

SHELL = web.AppKey("shell", ShellContext)
SCRAPER_TASK = web.AppKey("scraper_task", asyncio.Task[None])
# Set once the scraper's first round has ended (``Scraper.first_round``).
FLEET_KNOWN = web.AppKey("fleet_known", asyncio.Event)
REQUEST_ID = web.RequestKey("request_id", str)
MODELS = web.AppKey("model_discovery", ModelDiscovery)
WORKER = web.AppKey("worker", WorkerLink)
SHARING = web.AppKey("sharing", SharedRouting)
