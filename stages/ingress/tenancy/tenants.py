"""Tenants: whose request it is, by its API key, with that key's weight and limits.

``STREAMSERVE_KEY_LIMITS`` holds JSON, inline or in the file it names::

    {"default": {"tokens_per_minute": 200000, "max_concurrent": 64},
     "keys": {"sk-team-a": {"name": "team-a", "weight": 2, "tokens_per_minute": 20000,
                            "max_concurrent": 8, "min_priority": -10}}}

A key listed under ``keys`` is its own tenant (its ``name``, else a digest of the key: the
key itself never goes to Redis or the logs); any other request (another key, or none when
``STREAMSERVE_API_KEY`` is unset) is the ``default`` tenant. ``weight`` is the tenant's
share of the workers when several wait (gpu_worker/scheduling/fair_share.py); past
``tokens_per_minute`` (prompt plus completion tokens charged over the last 60 s, as they are
generated, a dropped stream's included; each replica's charges reach Redis within a second)
or ``max_concurrent`` sequences running (every choice of every prompt: ``n=4`` of 2 prompts
is 8), a request gets a 429 with Retry-After (stages/ingress/tenancy/limits.py); one asking
for more sequences than ``max_concurrent`` at once gets a 400 naming ``n``. Each of these is
off where it is absent or null.

``min_priority`` (default 0) is the lowest ``priority`` the key's requests may ask for. As
in vLLM, a lower priority is served first and retracts the running requests of higher ones,
so by default a client may only lower its own importance (ask for more than 0); a key may be
given a negative minimum to jump others, or a positive one to be served after them (its
requests that ask for nothing then run at it). Asking below it is a 403 naming ``priority``:
the value is well-formed, and another key may use it, so it is this key's permission that is
missing, not a mistake in the body. Batch lines are held to their batch owner's minimum.
Jobs written straight to Redis are not checked: whoever can write to the bus is an operator.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.sampling_checks import PRIORITY_LIMIT
from stages.ingress.errors import ApiError

KEY_LIMITS_ENV = "STREAMSERVE_KEY_LIMITS"
DEFAULT_TENANT = "default"
LIMIT_FIELDS = {"name", "weight", "tokens_per_minute", "max_concurrent", "min_priority"}
DEFAULT_PRIORITY = 0  # what a request that names no priority runs at (SamplingParams)


@dataclass(frozen=True)
class Tenant:
    id: str
    weight: float = 1.0
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    min_priority: int = DEFAULT_PRIORITY

    @property
    def limited(self) -> bool:
        return self.tokens_per_minute is not None or self.max_concurrent is not None

    def priority_of(self, given: int | None) -> int | None:
        """The priority this tenant's request runs at: `given` if the key may ask for it,
        else a 403 naming ``priority``. With none given: None (the default, 0, left out of
        the job) or the key's minimum where that is above 0."""
        if given is None:
            return self.min_priority if self.min_priority > DEFAULT_PRIORITY else None
        if given < self.min_priority:
            raise ApiError(403, f"priority {given} is below {self.min_priority}, the lowest "
                           "this API key may ask for (lower is served first)",
                           param="priority", code="priority_not_allowed")  # fmt: skip
        return given


class Tenants:
    def __init__(self, by_key: Mapping[str, Tenant] | None = None,
                 default: Tenant | None = None) -> None:  # fmt: skip
        self.by_key = dict(by_key or {})
        self.default = default or Tenant(DEFAULT_TENANT)
        self.by_id = {t.id: t for t in [self.default, *self.by_key.values()]}

    def for_key(self, key: str | None) -> Tenant:
        return self.by_key.get(key, self.default) if key is not None else self.default

    def named(self, tenant_id: str | None) -> Tenant:
        """The tenant of that id (a batch's, stored with it); the default if it is gone."""
        return self.by_id.get(tenant_id or DEFAULT_TENANT, self.default)


def tenants_from_env(environ: Mapping[str, str] = os.environ) -> Tenants:
    """The tenants ``STREAMSERVE_KEY_LIMITS`` configures; ValueError saying what is wrong."""
    raw = environ.get(KEY_LIMITS_ENV, "").strip()
    if not raw:
        return Tenants()
    try:
        text = raw if raw.startswith("{") else Path(raw).read_text()
        data = json.loads(text)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{KEY_LIMITS_ENV}: not JSON, nor a readable JSON file: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"default", "keys"}:
        raise ValueError(f'{KEY_LIMITS_ENV}: want an object with "default" and "keys"')
    default = _tenant(DEFAULT_TENANT, data.get("default") or {}, "default")
    keys = data.get("keys") or {}
    if not isinstance(keys, dict):
        raise ValueError(f'{KEY_LIMITS_ENV}: "keys" must map API keys to their limits')
    by_key = {}
    for key, spec in keys.items():
        digest = "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        by_key[key] = _tenant(digest, spec, f"keys[{digest}]")
    ids = [t.id for t in by_key.values()]
    if len(set(ids)) != len(ids) or DEFAULT_TENANT in ids:
        raise ValueError(f"{KEY_LIMITS_ENV}: two keys share a name (or one is named default)")
    return Tenants(by_key, default)


def _tenant(fallback_id: str, spec: Any, where: str) -> Tenant:
    if not isinstance(spec, dict) or set(spec) - LIMIT_FIELDS:
        raise ValueError(f"{KEY_LIMITS_ENV}: {where} must be an object with fields among "
                         f"{sorted(LIMIT_FIELDS)}")  # fmt: skip
    name = spec.get("name", fallback_id)
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"{KEY_LIMITS_ENV}: {where}: name must be a string without ':'")
    weight = spec.get("weight", 1.0)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not (0 < weight < math.inf)
    ):
        raise ValueError(f"{KEY_LIMITS_ENV}: {where}: weight must be a positive number")
    limits = {}
    for field in ("tokens_per_minute", "max_concurrent"):
        value = spec.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):  # fmt: skip
            raise ValueError(f"{KEY_LIMITS_ENV}: {where}: {field} must be a positive integer")
        limits[field] = value
    min_priority = spec.get("min_priority", DEFAULT_PRIORITY)
    if (isinstance(min_priority, bool) or not isinstance(min_priority, int)
            or not -PRIORITY_LIMIT <= min_priority < PRIORITY_LIMIT):  # fmt: skip
        raise ValueError(f"{KEY_LIMITS_ENV}: {where}: min_priority must be an integer in "
                         "[-2**31, 2**31)")  # fmt: skip
    return Tenant(name, float(weight), **limits, min_priority=min_priority)
