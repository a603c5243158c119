"""The overhead benchmark's measurement code, without engines or routers: what it counts."""

import asyncio
from types import SimpleNamespace

from bench import fit, overhead
from bench.stats import RequestRecord


class TreeProc:
    """A router whose parent process does nothing and whose workers take 1 s per reading."""

    def __init__(self) -> None:
        self.tree = 0.0

    def cpu_seconds(self) -> float:
        return 0.0

    def tree_cpu_seconds(self) -> float:
        self.tree += 1.0
        return self.tree


def _started(name, proc):
    return [(SimpleNamespace(name=name), proc, None)]


def test_a_slice_charges_a_router_the_cpu_of_its_whole_process_tree(monkeypatch):
    async def loop(*args, **kwargs):
        return [RequestRecord(index=0, status=200, ttft=0.1)], 1.0

    monkeypatch.setattr(overhead, "closed_loop", loop)
    proc = TreeProc()
    _, _, used = asyncio.run(overhead._slice(None, None, _started("kvproxy/x+w2", proc),
                                             "kvproxy/x+w2", 4, 1.0, 0.0, 0.5))
    assert used == 1.0


def test_idle_cpu_is_the_whole_process_tree_s(monkeypatch):
    monkeypatch.setattr(fit, "IDLE_S", 0.01)
    rates = asyncio.run(fit.idle_rates(_started("kvproxy/x+w2", TreeProc())))
    assert rates["kvproxy/x+w2"] > 0
