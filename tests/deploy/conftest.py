"""The compose runner borrows ``bench``'s port finder. ``bench`` is not an installed package: it is
imported from the repository root, put on the path here so that ``pytest tests/deploy`` runs on
its own."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
