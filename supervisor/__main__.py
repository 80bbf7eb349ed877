"""`python -m supervisor --model DIR --memory-budget SIZE ...` (the same as `moeslab-launch`)."""

import sys

from supervisor.main import main

sys.exit(main())
