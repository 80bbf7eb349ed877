"""`python -m gpuworker`: run the GPU worker process."""

import sys

from gpuworker.main import main

sys.exit(main())
