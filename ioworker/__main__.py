"""`python -m ioworker`: run one I/O worker process."""

import sys

from ioworker.main import main

sys.exit(main())
