"""`python -m gpu_worker`: the worker stage (gpu_worker/cli.py)."""

from __future__ import annotations

import sys

from gpu_worker.cli import main

sys.exit(main())
