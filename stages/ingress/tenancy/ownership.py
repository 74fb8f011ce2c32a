"""Who owns what an API key makes: its files, batches and requests.

With API keys configured (``STREAMSERVE_API_KEY``) a request's owner is its key's tenant
when ``STREAMSERVE_KEY_LIMITS`` lists the key (stages/ingress/tenancy/tenants.py), and otherwise a
digest of the key: two unlisted keys share the default tenant's limits, never their data.
The digest is the one a listed key without a name gets, so listing a key keeps its data its
own; the key itself never reaches Redis or the logs. With no keys configured there is one
owner and everything is open, as before tenants: the owner is None, which the stores
(batch_store/files.py, batch_store/batches.py) and the checks below take as "sees everything".

A request's record (``BusConfig.request_key``) is ``<sub-requests> <owner>``, so an abort or
a resumed stream from another owner is answered 404, as an unknown request is.
"""

from __future__ import annotations

import hashlib

from aiohttp import web

from stages.ingress.tenancy.auth import KEYS_CHECKED, bearer_key
from stages.ingress.tenancy.tenants import Tenants


def key_owner(key: str) -> str:
    """The owner of an API key that no tenant lists."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def owner_of(request: web.Request, tenants: Tenants) -> str | None:
    """The owner of what this request makes and sees; None with no API keys configured."""
    key = bearer_key(request)
    if not request.app.get(KEYS_CHECKED, False) or key is None:
        return None
    tenant = tenants.by_key.get(key)
    return tenant.id if tenant is not None else key_owner(key)


def sees(caller: str | None, owner: str | None) -> bool:
    """Whether `caller` may read or stop what `owner` made (no owner: single-tenant)."""
    return caller is None or caller == owner


def request_record(count: int, owner: str | None) -> str:
    return str(count) if owner is None else f"{count} {owner}"


def read_request_record(raw: bytes | str) -> tuple[int, str | None]:
    """(sub-requests, owner) of a request's record; a bare count has no owner."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    count, _, owner = text.partition(" ")
    return int(count), owner or None
