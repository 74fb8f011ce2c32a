"""The jobs themselves: `GenerateRequest` (text, chat or token ids; the tokenizer's input),
`TokenizedRequest` (token ids; the router's and the workers' input) and `Abort`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobs.wire import FLOAT, IDS, INT, LIST, MAP, STR, Message, ProtocolError


@dataclass
class GenerateRequest(Message):
    """A job in text (``prompt``), chat (``messages``) or token-id (``input_ids``) form; a chat
    may name ``tools`` (OpenAI's function definitions), which its template renders.
    ``tenant`` and ``weight`` say whose job it is and its share when several tenants wait
    (the ingress sets them from the API key; gpu_worker/scheduling/fair_share.py)."""

    KIND = "generate"
    FIELDS = {
        "rid": STR, "reply_to": STR, "prompt": STR, "messages": LIST, "input_ids": IDS,
        "sampling": MAP, "created": FLOAT, "tools": LIST, "tenant": STR, "weight": FLOAT,
    }  # fmt: skip
    OPTIONAL = frozenset({"prompt", "messages", "input_ids", "created", "tools", "tenant",
                          "weight"})  # fmt: skip

    rid: str
    reply_to: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    created: float | None = None  # unix time the job entered the system, for latency figures
    tools: list[dict[str, Any]] | None = None
    tenant: str | None = None
    weight: float | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("prompt", "messages", "input_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ProtocolError(
                f"a generate job needs exactly one of prompt, messages, input_ids; got {given}"
            )
        if self.tools is not None and self.messages is None:
            raise ProtocolError("tools come with a chat job (messages)")
        _check_weight(self.weight)


@dataclass
class TokenizedRequest(Message):
    """A token-id job. ``attempts`` counts the workers that were handed it and died before
    finishing it (the reaper adds them when it requeues the job; jobs/job_failures.py): past
    ``max_deliveries`` the job is set aside instead of killing another worker."""

    KIND = "tokenized"
    FIELDS = {
        "rid": STR, "reply_to": STR, "input_ids": IDS, "sampling": MAP, "created": FLOAT,
        "tenant": STR, "weight": FLOAT, "attempts": INT,
    }  # fmt: skip
    OPTIONAL = frozenset({"created", "tenant", "weight", "attempts"})

    rid: str
    reply_to: str
    input_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    created: float | None = None
    tenant: str | None = None  # as the GenerateRequest's
    weight: float | None = None
    attempts: int | None = None

    def __post_init__(self) -> None:
        _check_weight(self.weight)
        if self.attempts is not None and not 0 <= self.attempts < 2**31:
            raise ProtocolError(f"attempts must be a count >= 0; got {self.attempts}")


def _check_weight(weight: float | None) -> None:
    # A share: zero, negative or infinite would stall or starve the tenant's queue.
    if weight is not None and not 0 < weight < float("inf"):
        raise ProtocolError(f"weight must be a positive finite number; got {weight}")


@dataclass
class Abort(Message):
    KIND = "abort"
    FIELDS = {"rid": STR}

    rid: str
