"""Send one generation job to a running moeslab coordinator (see shared/cli_send.py).

python scripts/send.py --endpoint ipc://RUN_DIR/jobs --prompt "Hello" [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from shared.cli_send import main
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shared.cli_send import main

if __name__ == "__main__":
    sys.exit(main())
