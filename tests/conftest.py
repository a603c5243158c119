"""Every asynchronous test runs on uvloop, the loop ``kvproxy serve`` runs on, so that a path that
behaves differently there (transports, ``set_protocol``, timers) is tested as it ships. The
reliability tier, which is the relay's rule book, also runs on asyncio's own loop: the proxy's
code must not depend on either loop's quirks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop

_BOTH: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "asyncio": asyncio.new_event_loop,
}
_SHIPPED: Mapping[str, Callable[[], asyncio.AbstractEventLoop]] = {"uvloop": uvloop.new_event_loop}


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return _BOTH if "reliability" in item.path.parts else _SHIPPED
