"""Child processes of a benchmark: start pinned, wait until they answer, measure, stop by PID.

Rules:
- Every process started here is stopped here, by its own PID (SIGTERM, then SIGKILL after a grace
  period); children it spawned are found by PID before it is stopped and killed by PID after.
- Pinning is optional and explicit: ``cores`` becomes ``taskset -c``.
- Readiness is an HTTP answer, never a sleep.
- CPU time is read from ``/proc/<pid>/stat`` (user + system, all threads, plus waited-for children).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_range(count: int, start: int = 20000, stop: int = 32000) -> int:
    """A port P such that P..P+count-1 are all free on loopback (best effort).

    Below Linux's ephemeral range (32768-60999), so that outgoing connections of this or any
    other process cannot take one of them between this check and the engines' bind.
    """
    port = start + random.randrange(stop - start - count)
    for _ in range(200):
        if all(_is_free(port + k) for k in range(count)):
            return port
        port += count + 1
        if port + count >= stop:
            port = start
    raise RuntimeError("no free port range")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Managed:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cores: str | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Managed:
        argv = list(self.argv)
        if self.cores is not None and shutil.which("taskset"):
            argv = ["taskset", "-c", self.cores, *argv]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_http(
        self, url: str, *, timeout_s: float = 60.0, headers: Mapping[str, str] | None = None
    ) -> None:
        """Poll ``url`` until it answers 200; raise with the log tail if the process dies."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited: {self.log_tail()}")
            status, last = http_get(url, headers=headers)
            if status == 200:
                return
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready at {url} after {timeout_s}s ({last}): "
                           f"{self.log_tail()}")

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def tree_cpu_seconds(self) -> float:
        """CPU of the process and its live children: a router started with workers (e.g.
        ``kvproxy/...+w2``) serves from the children, whose CPU the parent's stat omits."""
        return tree_cpu_seconds(self.pid)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pid = self.proc.pid
        children = descendants(pid)  # e.g. worker processes; stopped by PID after the parent
        os.kill(pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        for child in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)


def http_get(
    url: str, *, headers: Mapping[str, str] | None = None, timeout_s: float = 2.0
) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, str(exc)
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid`` (all its threads), in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime is field 14 -> index 11.
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))
    return ticks / CLOCK_TICKS


def descendants(pid: int) -> list[int]:
    """PIDs of ``pid``'s children, recursively (from /proc/*/stat)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out.extend(kids)
        todo.extend(kids)
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU of ``pid`` and its live descendants (``taskset`` execs, so pid is the real process)."""
    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            total += cpu_seconds(p)
        except (OSError, ValueError):
            continue
    return total


def stop_all(procs: Sequence[Managed]) -> None:
    for p in reversed(procs):
        try:
            p.stop()
        except Exception as exc:
            print(f"warning: stopping {p.name}: {exc}")


@contextlib.contextmanager
def pinned(cores: str | None) -> Iterator[None]:
    """This process (the load generator) on ``cores`` while inside; None: left as it is."""
    old = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)
