"""A job that cannot be served: the error its requester gets, and what people read about it.

A job's content must never end a process. Whatever a stage or a worker raises while it
checks or handles one job (a ValueError from a check, a RecursionError from a grammar nested
100,000 deep, an OverflowError from a huge number, a MemoryError from one giant field) is
that job's failure: the job is acknowledged, an ErrorReply goes to its ``reply_to`` and, for
what is not a plain mistake of the client's, a dead letter with the reason goes to
``<p>:dead-letter``. `failure_reply` says which error a requester sees for an exception: a 400
for the client's mistakes, a 500 that does not show our internals for the rest.

An entry that is not a well-formed message still gets an answer when its requester can be
read from it (`reply_address`: the ``rid`` and ``reply_to`` of the msgpack map, when they are
strings), so a direct client that sent a malformed job is told why instead of waiting.

A job that keeps killing the processes that take it (a crash no ``except`` can catch: a
segfault, the kernel's OOM killer) is counted: every consumer that was handed it and died
adds one delivery (the stream's own count for a CPU stage, a worker's and the job's
``attempts`` field across the reaper's requeues), and past ``BusConfig.max_deliveries`` the
job is dead-lettered with an error reply (`too_many_deliveries`) instead of being handed to
yet another consumer.
"""

from __future__ import annotations

from typing import Any

import msgpack

from jobs.field_error import FieldError
from jobs.protocol import ErrorReply, ProtocolError

# What a job too deep, too large or with too huge a number makes any code raise: the
# client's doing wherever it happens.
OVERSIZED = (RecursionError, MemoryError, OverflowError)
# What a check of one job's fields raises on a bad value: the client's mistake there, but a
# bug of ours when it escapes from code that was not checking anything.
BAD_VALUES = (ValueError, TypeError, LookupError, ArithmeticError, UnicodeError)
MESSAGE_LIMIT = 500  # characters of an exception's text a requester is shown


def failure_reply(rid: str, exc: BaseException, who: str, checking: bool = False) -> ErrorReply:
    """The ErrorReply for job `rid` after `who` (a stage or worker name) raised `exc` on it
    alone: a 400 (naming the field when it can) for the client's mistake, else a 500 that
    does not show our internals. `checking`: `exc` came out of the checks of the job's
    fields, so a bad value is the client's."""
    client_fault = isinstance(exc, (FieldError, ProtocolError, *OVERSIZED)) or (
        checking and isinstance(exc, BAD_VALUES)
    )
    if client_fault:
        param, code = (exc.field, exc.code) if isinstance(exc, FieldError) else (None, None)
        return ErrorReply(rid, 400, _describe(exc), "invalid_request_error", param, code)
    return ErrorReply(rid, 500, f"{who} could not handle this request", "internal_error")


def too_many_deliveries(rid: str, deliveries: int) -> ErrorReply:
    """The ErrorReply for a job set aside because its consumers died while holding it."""
    return ErrorReply(
        rid, 500,
        f"this request was handed to {deliveries} consumers that each died before finishing "
        "it; it was set aside (dead-letter stream) and will not be retried",
        "internal_error", None, "poison_job",
    )  # fmt: skip


def _describe(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "the request is nested too deeply to be read"
    if isinstance(exc, MemoryError):
        return "the request is too large to be handled"
    if isinstance(exc, OverflowError):
        return f"a number in the request is too large: {exc}"[:MESSAGE_LIMIT]
    text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def reply_address(payload: bytes | None) -> tuple[str, str] | None:
    """(rid, reply_to) of an entry that did not decode as a message, when its payload is a
    msgpack map holding both as strings; None otherwise. Never raises."""
    if not payload:
        return None
    try:
        data: Any = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:  # bytes that are not msgpack, or too deep for the unpacker
        return None
    if not isinstance(data, dict):
        return None
    rid, reply_to = data.get("rid"), data.get("reply_to")
    if isinstance(rid, str) and isinstance(reply_to, str) and rid and reply_to:
        return rid, reply_to
    return None


def malformed_reply(payload: bytes | None, error: ProtocolError) -> tuple[str, ErrorReply] | None:
    """(reply_to, ErrorReply) answering an entry that is not a well-formed message, when its
    requester can be read from it."""
    address = reply_address(payload)
    if address is None:
        return None
    rid, reply_to = address
    message = f"malformed job: {_describe(error)}"
    return reply_to, ErrorReply(rid, 400, message, "invalid_request_error", error.field)
