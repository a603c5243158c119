"""Tests of the benchmark code import ``bench`` from the repository root (not an installed
package), and ``tiers`` (skip or fail when outside software is missing) from ``tests/``."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
TESTS = str(Path(__file__).resolve().parents[1])
for path in (ROOT, TESTS):
    if path not in sys.path:
        sys.path.insert(0, path)
