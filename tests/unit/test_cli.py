"""``kvproxy``'s command line: logging flags on either side of the sub-command, one-line errors,
``--version``."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib import metadata

import orjson
import pytest

from proxy.cli import EXIT_CONFIG, build_parser, main
from proxy.observe import accesslog


@pytest.mark.parametrize(
    ("argv", "level", "fmt"),
    [
        (["serve"], "info", "text"),
        (["--log-level", "debug", "serve"], "debug", "text"),
        (["serve", "--log-level", "debug"], "debug", "text"),
        (["--log-level", "error", "demo", "--log-level", "debug"], "debug", "text"),
        (["--log-format", "json", "serve", "--config", "x.toml"], "info", "json"),
        (["demo", "--port", "0", "--log-format", "json"], "info", "json"),
    ],
)
def test_logging_flags_before_or_after_the_sub_command(
    argv: list[str], level: str, fmt: str
) -> None:
    args = build_parser().parse_args(argv)
    assert (args.log_level, args.log_format) == (level, fmt)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--log-level", "loud"], "kvproxy: --log-level: 'loud' is not one of debug"),
        (["--log-level", "", "demo"], "kvproxy: --log-level: '' is not one of"),
        (["--log-format", "xml", "serve"], "kvproxy: --log-format: 'xml' is not one of text, json"),
    ],
)
def test_a_bad_logging_flag_is_one_line_and_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith(message)
    assert err.count("\n") == 1


def test_a_bad_level_from_the_installed_command_has_no_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--log-level", "verbose"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == EXIT_CONFIG
    assert done.stderr.strip().splitlines() == [
        "kvproxy: --log-level: 'verbose' is not one of debug, info, warning, error, critical"
    ]


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvproxy {metadata.version('kvproxy')}"


def test_json_process_log_lines() -> None:
    name = "proxy.server.lifecycle"
    record = logging.LogRecord(name, logging.WARNING, __file__, 1, "up %d", (3,), None)
    doc = orjson.loads(accesslog.json_formatter().format(record))
    assert (doc["level"], doc["logger"], doc["message"]) == ("WARNING", name, "up 3")
    assert "time" in doc


def test_serve_raises_its_open_files_limit_to_the_hard_one() -> None:
    """A proxy holds a descriptor per client connection, engine connection and stream: a low
    soft limit (1,024 by many defaults) is raised as far as the hard limit lets it."""
    script = (
        "import resource\n"
        "from proxy.cli import raise_open_files_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=30).stdout.split()
    returned, soft, hard = (int(v) for v in out)
    assert returned == soft and soft > 64
    assert soft == hard or hard == -1  # -1: no hard limit (raised to a cap instead)
