"""`python -m stages.cli`: the `streamserve` command without its console script."""

import sys

from stages.cli.main import main

sys.exit(main())
