"""Command line of the engine sidecar: ``kvproxy-sidecar sim|vllm``.

Each backend owns its own arguments (``add_arguments``) and its entry point (``run``); this module
only dispatches. It imports only the backend that was asked for, so a backend whose imports fail
(say, on a host built for the other one) never stops the other from starting.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

_BACKENDS = {
    "sim": ("engine_sidecar.sim.main", "serve one or more simulated vLLM engines (no GPU)"),
    "vllm": ("engine_sidecar.vllm.main", "start and supervise a real vLLM OpenAI server"),
}


class _Backend(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(module: str) -> _Backend:
    return cast(_Backend, importlib.import_module(module))


def build_parser(backend: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``backend``'s own arguments are loaded (none when it is not known)."""
    parser = argparse.ArgumentParser(prog="kvproxy-sidecar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="backend", required=True)
    for name, (module, help_text) in _BACKENDS.items():
        backend_parser = sub.add_parser(name, help=help_text)
        if name == backend:
            _load(module).add_arguments(backend_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    backend = next((a for a in args_list if not a.startswith("-")), None)
    args = build_parser(backend).parse_args(args_list)
    module, _ = _BACKENDS[args.backend]
    return _load(module).run(args)


if __name__ == "__main__":
    sys.exit(main())
