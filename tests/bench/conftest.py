"""Tests of the benchmark code import ``bench`` from the repository root (not an installed
package)."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
