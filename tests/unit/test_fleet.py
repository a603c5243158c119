import pytest

from proxy.core.config import Config
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.fleet.engines import Fleet


def test_removed_engines_are_forgotten_once_idle() -> None:
    pool = PoolConfig("target", "m", (EngineConfig("static", "http://127.0.0.1:9"),))
    left: list[tuple[str, str]] = []
    fleet = Fleet(Config(pools=(pool,)), on_remove=lambda p, name: left.append((p, name)))
    for i in range(3):
        fleet.add("target", EngineConfig(f"found-{i}", f"http://127.0.0.1:{10 + i}"))
    busy = fleet.get("found-0")
    busy.state.on_dispatch()
    for i in range(3):
        fleet.remove(f"found-{i}")
    assert left == [("target", "found-0"), ("target", "found-1"), ("target", "found-2")]
    # A leaver stays reachable for a retry while it has requests open, and the newest one for the
    # retries of rankings made just before it left; older idle leavers are dropped.
    assert fleet.get("found-0") is busy
    assert fleet.get("found-2").name == "found-2"
    with pytest.raises(KeyError):
        fleet.get("found-1")
    assert [e.name for e in fleet.pool("target")] == ["static"]
