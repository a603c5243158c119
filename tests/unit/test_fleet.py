import pytest

from proxy.core.config import Config
from proxy.core.fleet_config import EngineConfig, PoolConfig
from proxy.fleet.engines import _KEEP_REMOVED, Fleet


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
    # Routing sees none of them; bookkeeping still finds every recent leaver.
    assert [fleet.live(f"found-{i}") for i in range(3)] == [None, None, None]
    assert fleet.get("found-0") is busy and fleet.get("found-1").name == "found-1"
    # Past the bound on kept leavers, old idle ones are dropped; one with requests open stays.
    for i in range(3, 3 + _KEEP_REMOVED):
        fleet.add("target", EngineConfig(f"found-{i}", f"http://127.0.0.1:{10 + i}"))
        fleet.remove(f"found-{i}")
    assert fleet.get("found-0") is busy
    with pytest.raises(KeyError):
        fleet.get("found-1")
    assert [e.name for e in fleet.pool("target")] == ["static"]
