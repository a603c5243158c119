"""Registry discovery never counts one engine twice (``proxy.tenancy.shared_state.RegistrySync``):
a registered engine at a configured engine's URL, or at the URL of one already discovered, is
ignored with one warning while it stays registered."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from proxy.core.breaker import Breaker
from proxy.core.config import BreakerConfig
from proxy.core.fleet_config import EngineConfig
from proxy.tenancy.shared_state import EngineRecord, RegistrySync


@dataclass
class _Engine:
    name: str
    breaker: Breaker


class _Fleet:
    def __init__(self, static: dict[str, str]) -> None:
        self.engines = dict(static)

    def __iter__(self) -> Iterator[_Engine]:
        return iter([_Engine(n, Breaker(BreakerConfig())) for n in self.engines])

    def add(self, pool: str, engine: EngineConfig) -> None:
        assert engine.name not in self.engines
        self.engines[engine.name] = engine.url

    def remove(self, name: str) -> None:
        del self.engines[name]


def _record(name: str, url: str) -> EngineRecord:
    return EngineRecord(name, "target", "llama", url)


def test_an_engine_registered_at_a_configured_engines_url_is_not_added_again(
        caplog: pytest.LogCaptureFixture) -> None:
    fleet = _Fleet({"a": "http://10.0.0.5:8000"})
    sync = RegistrySync(fleet, {"target": "llama"}, ["http://10.0.0.5:8000"])
    with caplog.at_level(logging.WARNING, logger="kvproxy.shared"):
        for _ in range(3):  # one warning, not one per change of the registry
            sync([_record("target@10.0.0.5:8000", "http://10.0.0.5:8000/"),
                  _record("target@10.0.0.6:8000", "http://10.0.0.6:8000")])
    assert fleet.engines == {"a": "http://10.0.0.5:8000", "target@10.0.0.6:8000":
                             "http://10.0.0.6:8000"}
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring registered engine 'target@10.0.0.5:8000': another engine is already routed "
        "to at http://10.0.0.5:8000"]


def test_of_two_records_at_one_url_the_discovered_one_stays_and_the_other_takes_over_later(
) -> None:
    fleet = _Fleet({})
    sync = RegistrySync(fleet, {"target": "llama"})
    sync([_record("z-old", "http://h:1")])
    sync([_record("a-new", "http://H:1"), _record("z-old", "http://h:1")])
    assert fleet.engines == {"z-old": "http://h:1"}  # not by name: the one already routed to
    sync([_record("a-new", "http://H:1")])  # the old record expired
    assert fleet.engines == {"a-new": "http://H:1"}
    fresh = _Fleet({})
    RegistrySync(fresh, {"target": "llama"})([_record("b", "http://h:1"),
                                              _record("a", "http://h:1")])
    assert fresh.engines == {"a": "http://h:1"}  # every process picks the same one
