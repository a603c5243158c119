"""``python -m engine_sidecar`` is ``kvproxy-sidecar``."""

import sys

from engine_sidecar.cli import main

sys.exit(main())
