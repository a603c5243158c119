"""A real ``redis-server`` process on a free loopback port, for tests; stopped by its PID."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

import pytest
import redis

# Generous Redis timeouts for tests that need Redis to answer: the test machine may be busy.
SLOW_OK = {"op_timeout_s": 2.0, "connect_timeout_s": 2.0}


@dataclass
class RedisServer:
    port: int
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    pytest.fail(f"redis-server exited with {self.proc.returncode}")
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        return
                if time.monotonic() > deadline:
                    pytest.fail("redis-server did not answer PING within 10 s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server (SIGKILL: no shutdown save, like a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def flush(self) -> None:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
        try:
            client.flushall()
        finally:
            client.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisFactory:
    def __init__(self) -> None:
        self.servers: list[RedisServer] = []

    def start(self) -> RedisServer:
        server = RedisServer(free_port())
        self.servers.append(server)
        server.start()
        return server

    def stop_all(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.resume()
            server.stop()
