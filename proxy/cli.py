"""Command line: ``kvproxy serve`` and ``kvproxy demo``.

Rules: this is the only place that picks the event loop (uvloop) and configures logging: the
process log on stderr (``--log-level``, ``--log-format text|json``, given before or after the
sub-command), the access log (``[log] access``) on stdout. A bad configuration or a bad logging flag
stops start-up with exit status 2 and one line naming the problem; a clean shutdown after SIGTERM
or Ctrl-C exits 0.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import resource
import sys
from collections.abc import Coroutine, Sequence
from importlib import metadata
from typing import Any

import uvloop

from proxy.core.config import Config
from proxy.core.configload import load_config
from proxy.core.errors import ConfigError
from proxy.demo import run_demo
from proxy.observe import accesslog
from proxy.server.lifecycle import run_server
from proxy.server.worker import WorkerSeat
from proxy.server.workers import run_workers, worker_command

EXIT_CONFIG = 2
EXIT_START = 1
# With no hard limit on open files, the soft one is raised this far (the kernel's usual nr_open).
_OPEN_FILES_CAP = 1 << 20
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS: tuple[str, ...] = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def package_version() -> str:
    try:
        return metadata.version("kvproxy")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvproxy", description="KV-cache-aware OpenAI-compatible routing proxy for vLLM"
    )
    parser.add_argument("--version", action="version", version=f"kvproxy {package_version()}")
    _add_logging(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the proxy from a TOML configuration")
    _add_logging(serve, top=False)
    serve.add_argument("--config", metavar="FILE.toml", help="configuration file")
    _add_listen(serve, default_port=None)
    serve.add_argument(
        "--workers", default="1", metavar="N",
        help="worker processes on the one port, routing as one (default 1; auto: one per core)",
    )
    # Set by the parent of ``--workers N`` on each worker: DIR:INDEX:COUNT.
    serve.add_argument("--worker-seat", default=None, help=argparse.SUPPRESS)
    serve.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable), e.g. --set routing.policy=least_load",
    )
    demo = sub.add_parser("demo", help="proxy plus simulated draft and target engines, one process")
    _add_logging(demo, top=False)
    _add_listen(demo, default_port=8000)
    demo.add_argument(
        "--time-scale",
        type=_time_scale,
        default=1.0,
        help="simulated engines run this many times faster than real hardware (default 1)",
    )
    return parser


def _add_logging(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # The sub-commands' copies have no default, so a flag given before the sub-command is not
    # overwritten by an absent one after it; one given after wins.
    parser.add_argument(
        "--log-level",
        default="info" if top else argparse.SUPPRESS,
        metavar="LEVEL",
        help=f"process log level: {', '.join(LOG_LEVELS)} (default info)",
    )
    parser.add_argument(
        "--log-format",
        default="text" if top else argparse.SUPPRESS,
        metavar="FORMAT",
        help="process log format on stderr: text or json (default text)",
    )


def _add_listen(parser: argparse.ArgumentParser, default_port: int | None) -> None:
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=default_port, help="port to listen on")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _logging_problem(args.log_level, args.log_format)
    if problem is not None:
        print(f"kvproxy: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(args.log_level, args.log_format)
    try:
        if args.command == "serve":
            cfg = _serve_config(args)
            raise_open_files_limit()  # workers inherit it
            workers, seat = _workers(args.workers), _seat(args.worker_seat)
            if seat is None and workers > 1:
                command = worker_command(_worker_args(args))
                return int(uvloop.run(run_workers(cfg, command, workers)))
            accesslog.install(cfg.log)
            return _run(run_server(cfg, worker=seat))
        return _run(_demo(args))
    except ConfigError as exc:
        print(f"kvproxy: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        # Most often the port is taken; a traceback would hide the one line that matters.
        print(f"kvproxy: cannot start: {exc}", file=sys.stderr)
        return EXIT_START


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, as servers do: every
    client connection, engine connection and stream holds one, and a shell's or a service
    manager's default soft limit (often 1,024) runs out far below what a proxy in front of a
    fleet holds open. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft
    want = hard if hard != resource.RLIM_INFINITY else max(soft, _OPEN_FILES_CAP)
    if soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft  # not ours to raise (a container's seccomp, say): serve with it
    return want


def _time_scale(raw: str) -> float:
    """``demo --time-scale``: a finite number > 0 (the simulated engines refuse anything else)."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number > 0")
    return value


def _workers(raw: str) -> int:
    """``--workers``: a count >= 1, or ``auto`` (the cores this process may run on)."""
    if raw.strip().lower() == "auto":
        return max(1, len(os.sched_getaffinity(0)))
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if not 1 <= count <= 256:
        raise ConfigError("--workers", f"{raw!r} is not a count in 1..256 or 'auto'")
    return count


def _seat(raw: str | None) -> WorkerSeat | None:
    if raw is None:
        return None
    directory, index, count = raw.rsplit(":", 2)
    return WorkerSeat(directory, int(index), int(count))


def _worker_args(args: argparse.Namespace) -> list[str]:
    """The command line of one worker: this one without ``--workers`` (the port comes later)."""
    out = ["--log-level", args.log_level, "--log-format", args.log_format, "serve"]
    if args.config is not None:
        out += ["--config", args.config]
    if args.host is not None:
        out += ["--host", args.host]
    for item in args.overrides:
        out += ["--set", item]
    return out


def _logging_problem(level: str, fmt: str) -> str | None:
    if level.strip().lower() not in LOG_LEVELS:
        return f"--log-level: {level!r} is not one of {', '.join(LOG_LEVELS)}"
    if fmt.strip().lower() not in LOG_FORMATS:
        return f"--log-format: {fmt!r} is not one of {', '.join(LOG_FORMATS)}"
    return None


def configure_logging(level: str, fmt: str) -> None:
    """The process log: ``level`` and ``fmt`` (text or json lines) on stderr."""
    handler = logging.StreamHandler()
    json_lines = fmt.strip().lower() == "json"
    text = logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(accesslog.json_formatter() if json_lines else text)
    logging.basicConfig(level=level.strip().upper(), handlers=[handler])


def _run(coro: Coroutine[Any, Any, None]) -> int:
    uvloop.run(coro)
    return 0


def _serve_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    if args.host is not None:
        overrides.append(f"server.host={args.host}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    cfg = load_config(args.config, os.environ, overrides)
    if not cfg.pools:
        raise ConfigError("pools", "no pools configured: add [[pools]] with engines to the file")
    return cfg


async def _demo(args: argparse.Namespace) -> None:
    await run_demo(host=args.host or "127.0.0.1", port=args.port, time_scale=args.time_scale)


if __name__ == "__main__":
    sys.exit(main())
