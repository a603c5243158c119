"""Runs the services of one compose.yaml profile as plain local processes (no Docker engine).

What a container would get from Docker is re-created locally: ``${VAR:-default}`` interpolation,
bind-mounted config directories, host names (service names and network aliases) and container
ports. Every container port becomes a free local port, and the mounted config files are copied with
``http://<host>:<port>`` rewritten to the matching ``127.0.0.1:<local port>``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import free_port_range

ROOT = Path(__file__).resolve().parents[2]
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")
# Entry points of the kvproxy image, as this checkout provides them.
EXECUTABLES = {
    "kvproxy": [sys.executable, "-m", "proxy"],
    "kvproxy-sidecar": [sys.executable, "-m", "engine_sidecar"],
    "python": [sys.executable],
    "python3": [sys.executable],
}


def interpolate(value: str, env: Mapping[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def services_for(compose: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    """Services a ``docker compose --profile <profile> up`` starts."""
    return {name: svc for name, svc in compose["services"].items()
            if not svc.get("profiles") or profile in svc["profiles"]}


def start_order(services: dict[str, dict[str, Any]]) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...] = ()) -> None:
        if name in order:
            return
        if name in path:
            raise ValueError(f"depends_on cycle through {name}")
        for dep in services[name].get("depends_on", {}):
            visit(dep, (*path, name))
        order.append(name)

    for name in services:
        visit(name)
    return order


def hostnames(name: str, svc: dict[str, Any]) -> list[str]:
    aliases: list[str] = []
    for net in (svc.get("networks") or {}).values():
        aliases += (net or {}).get("aliases", [])
    return [name, *aliases]


def _arg_after(cmd: list[str], flag: str, default: str | None = None) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else default


@dataclass
class Running:
    name: str
    proc: subprocess.Popen[bytes]
    ports: dict[int, int]  # container port -> local port
    log: Path


@dataclass
class LocalStack:
    compose: dict[str, Any]
    profile: str
    workdir: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    running: dict[str, Running] = field(default_factory=dict)
    port_map: dict[tuple[str, int], int] = field(default_factory=dict)  # (host, port) -> local

    @property
    def services(self) -> dict[str, dict[str, Any]]:
        return services_for(self.compose, self.profile)

    def plan_ports(self) -> None:
        """Give every container port of every service a local port, before anything starts, so
        config files can be rewritten for services that start later."""
        for name, svc in self.services.items():
            cmd = self.command(svc)
            ports = _container_ports(svc, cmd)
            first = free_port_range(len(ports))
            for i, port in enumerate(ports):
                for host in hostnames(name, svc):
                    self.port_map[(host, port)] = first + i

    def command(self, svc: dict[str, Any]) -> list[str]:
        raw = svc.get("command") or []
        return [interpolate(str(a), self.env) for a in raw]

    def local_port(self, name: str, port: int) -> int:
        return self.port_map[(name, port)]

    def rewrite_text(self, text: str) -> str:
        def sub(m: re.Match[str]) -> str:
            key = (m.group(2), int(m.group(3)))
            if key not in self.port_map:
                return m.group(0)
            return f"{m.group(1)}://127.0.0.1:{self.port_map[key]}"

        return re.sub(r"(http|redis)://([a-zA-Z0-9_.-]+):(\d+)", sub, text)

    def _mounts(self, name: str, svc: dict[str, Any]) -> dict[str, str]:
        """Container path -> local copy of each bind mount (config files rewritten)."""
        out: dict[str, str] = {}
        for vol in svc.get("volumes", []):
            src, dst = str(vol).split(":")[:2]
            if not src.startswith("."):
                continue  # a named volume: nothing to provide locally
            copy = self.workdir / name / dst.strip("/").replace("/", "_")
            shutil.copytree(ROOT / src, copy, dirs_exist_ok=True)
            for f in copy.rglob("*"):
                if f.is_file() and f.suffix in (".toml", ".yml", ".yaml"):
                    f.write_text(self.rewrite_text(f.read_text()))
            out[dst] = str(copy)
        return out

    def local_command(self, name: str, svc: dict[str, Any]) -> list[str]:
        cmd = self.command(svc)
        if not cmd:
            raise ValueError(f"service {name} has no command to run")
        mounts = self._mounts(name, svc)
        head = EXECUTABLES.get(cmd[0], [shutil.which(cmd[0]) or cmd[0]])
        args = []
        for arg in cmd[1:]:
            mapped = arg
            for dst, local in mounts.items():
                if arg.startswith(dst):
                    mapped = local + arg[len(dst):]
            args.append("127.0.0.1" if mapped == "0.0.0.0" else mapped)
        if "--port" in args:
            i = args.index("--port")
            args[i + 1] = str(self.local_port(name, int(args[i + 1])))
        elif cmd[0] == "redis-server":
            args += ["--port", str(self.local_port(name, 6379)), "--bind", "127.0.0.1"]
        return head + args

    def start(self, name: str) -> Running:
        svc = self.services[name]
        cmd = self.local_command(name, svc)
        env = {**self.env, **{k: interpolate(str(v), self.env)
                              for k, v in (svc.get("environment") or {}).items()}}
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=ROOT, start_new_session=True)
        ports = {p: local for (host, p), local in self.port_map.items() if host == name}
        self.running[name] = Running(name, proc, ports, log)
        return self.running[name]

    def healthcheck(self, name: str) -> list[str] | None:
        """The service's compose healthcheck as a local command (ports rewritten)."""
        test = (self.services[name].get("healthcheck") or {}).get("test")
        if not test or test[0] not in ("CMD", "CMD-SHELL"):
            return None
        cmd = [interpolate(str(a), self.env) for a in test[1:]]
        if cmd[0] == "redis-cli":
            return [shutil.which("redis-cli") or "redis-cli", "-p",
                    str(self.local_port(name, 6379)), *cmd[1:]]
        head = EXECUTABLES.get(cmd[0], [cmd[0]])
        body = [re.sub(r"127\.0\.0\.1:(\d+)",
                       lambda m: f"127.0.0.1:{self.local_port(name, int(m.group(1)))}", a)
                for a in cmd[1:]]
        return head + body

    def wait_healthy(self, name: str, timeout_s: float = 60.0) -> None:
        check = self.healthcheck(name)
        run = self.running[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if run.proc.poll() is not None:
                raise AssertionError(f"{name} exited ({run.proc.returncode}):\n{self.tail(name)}")
            if check is None or subprocess.run(check, capture_output=True, timeout=10,
                                               check=False).returncode == 0:
                return
            time.sleep(0.5)
        raise AssertionError(f"{name} not healthy in {timeout_s:.0f} s:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 30) -> str:
        text = self.running[name].log.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop_all(self) -> None:
        for run in reversed(list(self.running.values())):
            if run.proc.poll() is None:
                os.killpg(run.proc.pid, signal.SIGTERM)
        for run in self.running.values():
            try:
                run.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait()


def _container_ports(svc: dict[str, Any], cmd: list[str]) -> list[int]:
    if cmd and cmd[0] == "redis-server":
        return [6379]
    port = _arg_after(cmd, "--port")
    if port is None:
        return []
    engines = int(_arg_after(cmd, "--engines", "1") or 1)
    return [int(port) + i for i in range(engines)]
