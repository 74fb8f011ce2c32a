"""FieldError: a bad value in a request, carrying the field it is about.

Whoever answers the request turns `field` into the ``param`` of its 400 (the ingress after
mapping it to the request's own name, e.g. ``max_tokens``), so nothing has to recover the
field from the message text.
"""

from __future__ import annotations


class FieldError(ValueError):
    def __init__(self, field: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code  # an OpenAI-style error code, e.g. "context_length_exceeded"
