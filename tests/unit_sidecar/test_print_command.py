"""``kvproxy-sidecar vllm --print-command``: one shell-quoted line that pastes back intact."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest

from engine_sidecar.vllm.main import add_arguments, run

ROOT = Path(__file__).resolve().parents[2]


def test_print_command_is_shell_quoted(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--profile", str(ROOT / "profiles" / "draft.toml"), "--print-command",
        "--python", "/opt/my venv/bin/python", "--model", "/models/tiny llama",
    ])  # fmt: skip
    assert run(args) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    argv = shlex.split(out)
    assert argv[0] == "/opt/my venv/bin/python"
    assert argv[argv.index("--model") + 1] == "/models/tiny llama"
    # The JSON speculative config survives the shell (its quotes would not, unquoted).
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "ngram"
