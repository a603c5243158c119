"""Test tiers that need software from outside Python: ``redis-server`` and vLLM for CPU.

Run by hand, such a tier is skipped when its software is missing. Under CI (``CI=true``) or the
full test command (``scripts/test.sh`` sets ``KVPROXY_REQUIRE_ALL_TIERS=1``), a missing piece fails
the run instead: a skipped tier proves nothing.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def every_tier_required() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get("KVPROXY_REQUIRE_ALL_TIERS") == "1"


def missing(what: str) -> NoReturn:
    """Skip for ``what`` is missing, or fail when every tier must run."""
    if every_tier_required():
        pytest.fail(f"{what}; this run requires every test tier", pytrace=False)
    pytest.skip(what)
