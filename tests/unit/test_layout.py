"""The package layout is the architecture: imports point only downward; the pure core stays pure.

Read from the source with ``ast`` (nothing is imported), so a violation fails here before it can
blur the layers. Layers, lowest first: ``core`` (configuration objects and every decision: no I/O,
no clock, no framework), ``observe`` (the proxy's own metrics and logs), ``fleet`` (the engines:
telemetry, scrapes, upstream sessions, background loops), ``tenancy`` (keys, limits, cache, state
shared through Redis), ``server`` (the aiohttp shell), then the entry points at the top of
``proxy/`` (the command line and the demo).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "proxy"
LAYERS = {"core": 0, "observe": 1, "fleet": 2, "tenancy": 3, "server": 4, "": 5}
# What the pure core may never reach for: frameworks, the network, the clock, other processes.
IMPURE = ("aiohttp", "asyncio", "redis", "prometheus_client", "socket", "time", "uvloop",
          "subprocess", "engine_sidecar")


def _package(module: str) -> str:
    """The sub-package ``module`` belongs to (itself, for a package); "" at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        found[".".join(rel.parts).removesuffix(".__init__")] = path
    return found


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


MODULES = _modules()


TOP = {"proxy", "proxy.__main__", "proxy.cli", "proxy.demo"}


def test_every_module_sits_in_a_known_package() -> None:
    for module in MODULES:
        assert _package(module) or module in TOP, f"{module} is outside the known packages"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_downward(module: str) -> None:
    here = _package(module)
    for name in _imports(MODULES[module]):
        if not name.startswith("proxy.") or (name in MODULES and _package(name) == here):
            continue
        target = name if name in MODULES else name.rsplit(".", 1)[0]
        if target not in MODULES or target == "proxy":
            continue
        there = _package(target)
        if there == here:
            continue
        assert LAYERS[there] < LAYERS[here], f"{module} imports {target}: upward or sideways"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _package(m) == "core"))
def test_the_pure_core_does_no_io(module: str) -> None:
    for name in _imports(MODULES[module]):
        top = name.split(".")[0]
        assert top not in IMPURE, f"{module} imports {name}: the core decides, the shell performs"


def test_proxy_never_imports_the_simulator() -> None:
    for module, path in MODULES.items():
        assert not any(n.startswith("engine_sidecar") for n in _imports(path)), module
