"""`python -m coordinator --config RUN_DIR/config.json [--death-fd N]`."""

import sys

from coordinator.main import main

sys.exit(main())
