"""`python -m gpu_worker`: the worker stage (gpu_worker/cli.py).

A worker that returns from `main` has said all it had to (its last tokens, its goodbye) to
Redis, so it ends without the interpreter's finalization: tearing down torch's modules and
objects took ~0.4 s for torch alone and ~0.8 s with a model loaded, which every stop and
restart of a deployment waited for. The exit handlers still run (a tensor-parallel rank 0
stops its followers in one), and the streams are flushed; a worker that raises ends as any
process does.
"""

from __future__ import annotations

import atexit
import os
import sys

from gpu_worker.cli import main

code = main()
atexit._run_exitfuncs()  # what finalization would run first (logging's flush among them)
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
