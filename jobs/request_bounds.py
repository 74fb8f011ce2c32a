"""The request bounds every process of a deployment applies alike.

The checks of the sampling-parameter table (jobs/sampling_checks.py), the grammar checks
(jobs/grammar.py) and the stages read the bounds here rather than from a `BusConfig` passed
down: a job's parameters are checked where it enters (ingress, direct client) and again in
the worker, and both must refuse the same values. Every process of a deployment gets the
same ``STREAMSERVE_*`` environment from `streamserve up`, so reading it once per process is
what keeps them in step. The defaults and their variables are `BusConfig`'s (runtime/config.py);
docs/BOUNDS.md lists them.

Threading: `request_bounds` is read from any thread; it is computed once, under
`functools.cache`'s lock. Tests that change the environment call `request_bounds.cache_clear`.
"""

from __future__ import annotations

import functools

from runtime.config import BusConfig


@functools.cache
def request_bounds() -> BusConfig:
    """This process's settings, read from the environment once (the bounds are its fields)."""
    return BusConfig.from_env()
