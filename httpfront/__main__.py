"""`python -m httpfront --listen HOST:PORT --jobs-endpoint E --model-id ID --ready-file F [--death-fd N]`."""

import sys

from httpfront.main import main

sys.exit(main())
