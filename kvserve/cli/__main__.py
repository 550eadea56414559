"""`python -m kvserve.cli ARGS`: the `kvserve` command."""

import sys

from kvserve.cli import main

sys.exit(main())
