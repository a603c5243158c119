"""The sidecar tests' Redis: a real redis-server on a free port, for one test."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pytest
import redis
from tiers import missing

from unit_sidecar.sidecars import free_port, wait_for


@pytest.fixture
def redis_url() -> Iterator[str]:
    server = shutil.which("redis-server")
    if server is None:
        missing("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        wait_for(lambda: _pings(client), what="redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
