"""The ids that name keys (a worker's, an ingress replica's, a shard's): what may be one.

An id is part of key names (``<p>:worker:<id>``, ``<p>:heartbeat:<id>``): a ':' inside one
would make one worker's stream name look like another's, a brace in a shard would end its
hash tag early, and a space or an empty id names nothing a person could read back. A reader
of ids someone else wrote (the workers set, an index) leaves out what `is_valid_id` refuses
rather than raise on it.
"""

from __future__ import annotations


def is_valid_id(value: object, forbidden: str = ":") -> bool:
    """Whether `value` may name a worker, a frontend or a shard in a key."""
    return (
        isinstance(value, str)
        and bool(value)
        and not any(c in forbidden or c.isspace() for c in value)
    )


def require_id(name: str, value: str, forbidden: str = ":") -> str:
    """`value`, or a ValueError saying why field `name` cannot hold it."""
    if not is_valid_id(value, forbidden):
        shown = " or ".join(repr(c) for c in forbidden)
        raise ValueError(f"{name} must be non-empty, without {shown} or whitespace; got {value!r}")
    return value
