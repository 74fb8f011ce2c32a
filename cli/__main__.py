"""`python -m cli`: the `streamserve` command without its console script."""

import sys

from cli.main import main

sys.exit(main())
