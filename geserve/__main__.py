"""`python -m geserve` runs the command line."""

import sys

from geserve.cli import main

sys.exit(main())
