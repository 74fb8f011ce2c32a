"""OpenAI's bounds of a batch's or a response's ``metadata``: 16 pairs of strings, keys of
at most 64 characters and values of at most 512. It is kept with its object for as long,
and shown with every read of it, so nothing past them is stored."""

from __future__ import annotations

from typing import Any

from jobs.errors import RequestError

MAX_METADATA_PAIRS = 16  # OpenAI's bounds of a batch's or a response's metadata
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512
METADATA_SCHEMA = {  # the same, for the OpenAPI description
    "type": "object", "maxProperties": MAX_METADATA_PAIRS,
    "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
    "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS},
}  # fmt: skip


def check_metadata(metadata: Any) -> None:
    """A batch's metadata (None: none), as OpenAI takes it; a 400 naming the bound."""
    if metadata is None:
        return
    if (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA_PAIRS
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise RequestError(400, f"metadata must be an object of at most {MAX_METADATA_PAIRS} "
                           "string values", param="metadata")  # fmt: skip
    problem = metadata_too_long(metadata)
    if problem is not None:
        raise RequestError(400, problem, param="metadata", code="invalid_value")


def metadata_too_long(metadata: dict[str, str]) -> str | None:
    """What makes string metadata longer than OpenAI allows (None: nothing): it is stored
    with its object for as long, and shown with it."""
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            return f"metadata keys hold at most {MAX_METADATA_KEY_CHARS} characters; got {len(key)}"
        if len(value) > MAX_METADATA_VALUE_CHARS:
            return (f"metadata[{key!r}] holds {len(value)} characters, more than the "
                    f"{MAX_METADATA_VALUE_CHARS} allowed")  # fmt: skip
    return None
