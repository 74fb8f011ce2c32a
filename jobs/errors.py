"""`RequestError`: a request the pipeline refused or failed, on either side of the bus.

The fields are those of an ErrorReply (and of an OpenAI error body): an HTTP-like status, a
message, and the error's type, param and code. The direct client (bus/client.py) raises one
for an ErrorReply; the ingress raises its HTTP form, `ApiError` (stages/ingress/errors.py),
which adds only response headers and the rendering of the body.
"""

from __future__ import annotations

from jobs.protocol import ErrorReply


class RequestError(Exception):
    """The pipeline rejected or failed a request (its ErrorReply)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def from_reply(cls, reply: ErrorReply) -> RequestError:
        return cls(reply.status, reply.message, reply.type, reply.param, reply.code)
