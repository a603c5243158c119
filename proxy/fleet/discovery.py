"""Which model names each engine really serves, read from its ``/v1/models``.

Rules:
- One named task (``kvproxy-model-discovery``), owned by the app's cleanup context and cancelled
  on shutdown, asks every engine of the fleet at start-up and then every ``interval_s`` (slowly:
  served names change only when an engine restarts). Engines added at run time are asked in the
  next round.
- At most ``PARALLEL`` asks are open at once. Each ask is bounded: a timeout, no redirects, at
  most ``MAX_BYTES`` read and ``MAX_MODELS`` names kept; a bigger, malformed or failed answer is
  an error for that engine, retried next round.
- Logged once per change, never per round: a failure when it starts (or its text changes) and its
  recovery; a configured model that an engine does not list as a warning naming the pool, the
  engine and the model. The admin view shows the same per engine (``EngineModels.view``).
- ``parse_models`` and ``missing_models`` are pure; this module never changes routing: a pool's
  configured names stay routable, so a mismatch is reported, not hidden behind 404s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.core.config import Config
from proxy.fleet.engines import Engine, Fleet
from proxy.fleet.periodic import every

log = logging.getLogger(__name__)

REFRESH_S = 60.0
TIMEOUT_S = 5.0
# Engines asked at once: a round over 500 engines still ends within a second or two.
PARALLEL = 16
MAX_BYTES = 1024 * 1024
MAX_MODELS = 4096
_MAX_NAME = 512


class ModelsError(ValueError):
    """An engine's ``/v1/models`` answer that is not a model list."""


def parse_models(body: bytes) -> tuple[str, ...]:
    """The model ids in an OpenAI ``/v1/models`` answer (``{"object": "list", "data": [...]}``)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ModelsError("the answer is not JSON") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        raise ModelsError("the answer has no 'data' list")
    ids = [m.get("id") for m in data[:MAX_MODELS] if isinstance(m, dict)]
    return tuple(i for i in ids if isinstance(i, str) and 0 < len(i) <= _MAX_NAME)


def missing_models(configured: Sequence[str], served: Sequence[str]) -> tuple[str, ...]:
    """The configured names an engine does not serve, in configuration order."""
    have = set(served)
    return tuple(m for m in configured if m not in have)


@dataclass
class EngineModels:
    """What discovery last learned about one engine."""

    served: tuple[str, ...] | None = None
    missing: tuple[str, ...] = ()
    error: str | None = None

    def view(self) -> dict[str, Any]:
        served = None if self.served is None else list(self.served)
        return {"served": served, "missing": list(self.missing), "error": self.error}


class ModelDiscovery:
    def __init__(
        self,
        cfg: Config,
        fleet: Fleet,
        session: Callable[[], aiohttp.ClientSession],
        *,
        interval_s: float = REFRESH_S,
    ) -> None:
        self._cfg = cfg
        self._fleet = fleet
        self._session = session
        self._interval = interval_s
        self.engines: dict[str, EngineModels] = {}

    async def run(self) -> None:
        await every(self._interval, self.check_all, "model discovery")

    async def check_all(self) -> None:
        engines = list(self._fleet)
        # A few asks at a time: all at once, a fleet of hundreds of engines would open as many
        # new connections every round (next to the scrapes' own), doubling the descriptors.
        gate = asyncio.Semaphore(PARALLEL)

        async def ask(engine: Engine) -> None:
            async with gate:
                await self.check(engine)

        await asyncio.gather(*(ask(e) for e in engines))
        gone = set(self.engines) - {e.name for e in engines}
        for name in gone:
            del self.engines[name]

    async def check(self, engine: Engine) -> None:
        state = self.engines.setdefault(engine.name, EngineModels())
        try:
            served = parse_models(await self._fetch(engine))
        except (ModelsError, aiohttp.ClientError, TimeoutError) as exc:
            self._failed(engine, state, _describe(exc))
            return
        if state.error is not None:
            log.info("engine %s answers /v1/models again", engine.name)
        state.served, state.error = served, None
        pool = self._cfg.pool(engine.pool)
        missing = missing_models(pool.served if pool is not None else (), served)
        if missing != state.missing:
            for model in missing:
                log.warning(
                    "pool %s: engine %s does not serve model %r (it serves: %s)",
                    # Quoted as the configured name is: an engine's names are its own text, and a
                    # line break or a terminal escape in one must not forge a log line.
                    engine.pool, engine.name, model,
                    ", ".join(repr(m) for m in served[:8]) or "nothing",
                )  # fmt: skip
        state.missing = missing

    async def _fetch(self, engine: Engine) -> bytes:
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        async with self._session().get(
            engine.cfg.url + "/v1/models",
            headers=engine.auth,
            allow_redirects=False,
            timeout=timeout,
        ) as resp:
            if resp.status != 200:
                raise ModelsError(f"HTTP {resp.status}")
            body = bytearray()
            async for chunk in resp.content.iter_chunked(64 * 1024):
                body += chunk
                if len(body) > MAX_BYTES:
                    raise ModelsError(f"the answer is larger than {MAX_BYTES} bytes")
        return bytes(body)

    def _failed(self, engine: Engine, state: EngineModels, error: str) -> None:
        if state.error != error:
            log.warning("cannot read the models engine %s serves: %s", engine.name, error)
        state.error = error

    def view(self, engine: str) -> dict[str, Any] | None:
        state = self.engines.get(engine)
        return None if state is None else state.view()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {TIMEOUT_S:g} s"
    if isinstance(exc, ModelsError):
        return str(exc)
    # aiohttp's text can carry the engine's address; the class names the failure well enough.
    return type(exc).__name__
