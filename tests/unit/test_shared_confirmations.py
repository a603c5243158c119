"""Two processes' sharing shells over an in-memory transport: a first byte in one settles the
prompt in the other (``SharedRouting`` publishes it with the dispatch's place and merges it
through ``Policy.confirm``); confirmations of nothing merged are ignored and counted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import orjson
from prometheus_client import CollectorRegistry

from proxy.core.config import RoutingConfig
from proxy.core.costmodel import ExpectedTTFT
from proxy.core.engine_state import EngineState
from proxy.core.routeview import RouteKey
from proxy.core.sharing_state import Outbox
from proxy.tenancy.shared_routing import SharedRouting

CHAIN = tuple(range(101, 121))
KEY = RouteKey(chain=CHAIN, prompt_tokens=len(CHAIN) * 64.0)


class Log:
    """One stream every process appends to, each reading from its own cursor."""

    def __init__(self) -> None:
        self.entries: list[bytes] = []


class MemoryBus:
    live = True

    def __init__(self, log: Log) -> None:
        self._log, self._read = log, 0

    async def publish(self, payload: bytes) -> None:
        self._log.entries.append(payload)

    async def fetch(self) -> list[bytes]:
        new = self._log.entries[self._read :]
        self._read = len(self._log.entries)
        return new

    def listen(self, wake: Callable[[], None]) -> bool:
        return False


@dataclass
class Engine:
    name: str
    pool: str
    state: EngineState


@dataclass
class Side:
    shared: SharedRouting
    outbox: Outbox
    policy: ExpectedTTFT
    registry: CollectorRegistry

    def sample(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def _side(log: Log) -> Side:
    engines = [Engine(n, "p", EngineState(n, "p", f"http://{n}")) for n in ("e0", "e1")]
    outbox, policy, registry = Outbox(64), ExpectedTTFT(RoutingConfig()), CollectorRegistry()
    shared = SharedRouting(
        MemoryBus(log), outbox, {"p": policy}, lambda: engines, ttl_s=2.0, interval_s=0.025,
        max_chain=64, clock=lambda: 100.0, registry=registry, transport="memory",
    )  # fmt: skip
    return Side(shared, outbox, policy, registry)


async def test_a_first_byte_in_one_process_settles_the_prompt_in_the_other() -> None:
    log = Log()
    a, b = _side(log), _side(log)
    # A's request path: ``pick.rank`` then ``Relay._answered``, first byte from a retry on e1.
    a.policy.dispatched("job", KEY, "e0")
    a.outbox.dispatched("p", "e0", CHAIN, "job")
    await a.shared.sync()
    await b.shared.sync()
    assert b.policy.holdings.held_tokens(KEY, ["e0"]) == {"e0": KEY.tokens}
    assert b.policy.holdings.settled_tokens(KEY, ["e0", "e1"]) == {}  # provisional so far
    a.policy.first_byte("job", "e1")
    a.outbox.answered("job", "e1")
    await a.shared.sync()
    await b.shared.sync()
    # e1 holds nothing recorded, so nothing settles above what it holds (as in A) ...
    assert b.policy.holdings.settled_tokens(KEY, ["e0", "e1"]) == {}
    assert b.sample("kvproxy_sharing_merged_total", kind="confirmations") == 1.0
    assert a.sample("kvproxy_sharing_published_total", kind="confirmations") == 1.0
    # ... and one answered where it was sent settles there in both processes.
    a.outbox.dispatched("p", "e0", CHAIN, "job2")
    a.policy.dispatched("job2", KEY, "e0")
    a.policy.first_byte("job2", "e0")
    a.outbox.answered("job2", "e0")
    await a.shared.sync()
    await b.shared.sync()
    settled = b.policy.holdings.settled_tokens(KEY, ["e0", "e1"])
    assert settled == a.policy.holdings.settled_tokens(KEY, ["e0", "e1"]) == {"e0": KEY.tokens}
    assert b.sample("kvproxy_sharing_merged_total", kind="confirmations") == 2.0
    assert b.sample("kvproxy_sharing_dropped_total", reason="unknown_confirmation") == 0.0


async def test_confirmations_of_nothing_merged_are_ignored_and_counted() -> None:
    log = Log()
    b = _side(log)
    log.entries.append(orjson.dumps({
        "v": 1, "r": "peer", "s": 3, "d": [["p", "e0", list(CHAIN)], ["p", "nowhere", [1]]],
        "c": [[3, 1, "e0"], [2, 0, "e0"], [3, 0, "elsewhere"]],
    }))  # fmt: skip
    await b.shared.sync()
    assert b.sample("kvproxy_sharing_merged_total", kind="dispatches") == 1.0
    assert b.sample("kvproxy_sharing_dropped_total", reason="unknown_confirmation") == 3.0
    assert b.policy.holdings.settled_tokens(KEY, ["e0"]) == {}
    # Hostile confirmations spoil their whole message, as any bad field does.
    log.entries.append(b'{"v":1,"r":"peer","s":4,"c":[[4,0,"e0"]]}')
    await b.shared.sync()
    assert b.sample("kvproxy_sharing_dropped_total", reason="invalid") == 1.0


async def test_first_bytes_beyond_the_outbox_bound_are_counted_as_dropped() -> None:
    log = Log()
    a = _side(log)
    for i in range(65):
        a.outbox.answered(i, "e0")
    await a.shared.sync()
    assert a.sample("kvproxy_sharing_dropped_total", reason="confirm_batch_full") == 1.0
