#!/usr/bin/env python3
"""Start and supervise a moeslab system; the same as the `moeslab-launch` console script.

    python scripts/launch.py --model DIR --memory-budget 8GiB

Prints one JSON line (`{"event": "ready", ...}`) on stdout once every process is ready;
logs go to stderr. Flags: `supervisor/options.py`; what it does on failures: `supervisor/watch.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

from supervisor.main import main

if __name__ == "__main__":
    sys.exit(main())
