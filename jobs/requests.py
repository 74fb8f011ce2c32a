"""The jobs themselves: `GenerateRequest` (text, chat or token ids; the tokenizer's input),
`TokenizedRequest` (token ids; the router's and the workers' input) and `Abort`.

A job says in ``v`` the wire version its writer speaks, so a job written by an older client
still decodes, and its replies are written in the version it reads:

  v absent or 1   ``priority`` rides inside ``sampling`` (the form before version 2)
  v 2 (current)   ``priority`` is a job field beside ``sampling``, ``tenant`` and ``weight``
                  (the scheduler's, not the sampler's); ``sampling`` holds sampling
                  parameters only

Decoding lifts a version-1 job's priority out of its sampling map, so every stage sees one
form; the job keeps its ``v`` as it travels (a stage passes a version-1 job on with its
priority beside ``sampling``, which decodes the same). A version this code does not know, a
priority given both ways, or one inside ``sampling`` of a version-2 job is a `ProtocolError`
naming the field: the entry is dead-lettered and its requester gets a 400 naming it
(jobs/job_failures.py).

A job with ``bundle_replies`` true says its requester reads `TextDeltas` (jobs/protocol.py):
the detokenizer then writes, per batch it reads, one entry to the reply stream with the deltas
of every such job bound to it, where a job without it gets one entry per delta. The ingress
and `Client` ask for it; a program that reads its reply stream entry by entry need not.

A job with ``tag`` (a number its requester gives it, unique among the jobs that name the same
``reply_to``) and ``bundle_replies`` is named by its tag, not its rid, on the tokens stream
and in its reply stream's TextDeltas, except on its first delta (``seq`` 0), which carries
both: a rid of 34 characters per request per publish on those two streams was the largest
part of their bytes (issue 27). Its requester maps tags back to rids (bus/replies.py); a job
without a tag is named by its rid everywhere, as before.

A job with ``text_only`` and ``bundle_replies`` says its requester reads each delta's text
and how many tokens it adds, not their ids (an OpenAI stream without logprobs: its usage
comes from the Finish): its bundled deltas carry that count (``n``) in place of the ids,
which were 2.1 of the ~42 bytes into Redis a generated token cost on the 64-request burst
(issue 27). A job without it gets the ids, as before.

A job with ``pooling`` (``mean`` or ``last``; `POOLINGS`) asks for an embedding, not a
generation: the worker runs its prompt's prefill only (no prefix-cache hit, so every position
it pools is computed), pools the final hidden states over the prompt, L2-normalizes them, and
answers with one TokenItem carrying the vector (`TokenItem.embedding`) and its Finish. Its
``sampling`` is ``{"max_new_tokens": 0}`` (the ingress's), so the prompt alone must fit the
context; other sampling parameters are not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from jobs.sampling_checks import check_priority
from jobs.wire import (
    BOOL,
    FLOAT,
    IDS,
    INT,
    LIST,
    MAP,
    STR,
    WIRE_VERSION,
    Message,
    ProtocolError,
    check_version,
)

JOB_VERSION = WIRE_VERSION  # what the ingress and Client write; this code reads 1 to it
PRIORITY = "priority"
POOLINGS = ("mean", "last")  # an embedding job's pooling over its prompt (module docstring)
MAX_TAG = 2**63 - 1  # msgpack's largest signed int: a requester may count as it likes


def lift_priority(sampling: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """`sampling` without ``priority``, and the priority it held (None: none)."""
    rest = dict(sampling)
    return rest, rest.pop(PRIORITY, None)


def job_version(data: dict[str, Any]) -> int:
    """The version a job's wire map says it is written in (absent: 1)."""
    return check_version("job", data.get("v"))


def current_form(data: dict[str, Any], version: int) -> dict[str, Any]:
    """A job's wire map of `version` with ``priority`` beside ``sampling``: `data` itself
    where it is so already."""
    sampling = data.get("sampling")
    if not isinstance(sampling, dict) or PRIORITY not in sampling:
        return data
    if version >= 2:
        raise ProtocolError(
            f"priority is a job field since version 2, not a sampling parameter: "
            f"give it beside sampling (v={version})",
            field=PRIORITY,
        )
    if data.get(PRIORITY) is not None:
        raise ProtocolError("priority is given twice: in sampling and as a job field",
                            field=PRIORITY)  # fmt: skip
    sampling, priority = lift_priority(sampling)
    return {**data, "sampling": sampling, PRIORITY: priority}


class _Job(Message):
    """What the two job kinds share: their version, and one form whatever the version."""

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Message:
        version = job_version(data)
        job = super().from_wire(current_form(data, version))
        job.v = version  # kept: the requester's replies are written in it
        return job


@dataclass
class GenerateRequest(_Job):
    """A job in text (``prompt``), chat (``messages``) or token-id (``input_ids``) form; a chat
    may name ``tools`` (OpenAI's function definitions), which its template renders.
    ``tenant`` and ``weight`` say whose job it is and its share when several tenants wait
    (the ingress sets them from the API key; gpu_worker/scheduling/fair_share.py).
    ``priority`` is its scheduling class (vLLM's convention: lower is served first and
    retracted last; None: 0); ``v`` the version its writer speaks (module docstring)."""

    KIND = "generate"
    FIELDS = {
        "rid": STR, "reply_to": STR, "prompt": STR, "messages": LIST, "input_ids": IDS,
        "sampling": MAP, "created": FLOAT, "tools": LIST, "tenant": STR, "weight": FLOAT,
        "priority": INT, "v": INT, "bundle_replies": BOOL, "pooling": STR, "tag": INT,
        "text_only": BOOL,
    }  # fmt: skip
    OPTIONAL = frozenset(FIELDS) - {"rid", "reply_to", "sampling"}

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
    priority: int | None = None
    v: int = JOB_VERSION
    bundle_replies: bool | None = None  # its requester reads TextDeltas (module docstring)
    pooling: str | None = None  # an embedding job's (module docstring); None: a generation
    tag: int | None = None  # its name in its bundled replies (module docstring)
    text_only: bool | None = None  # its bundled deltas count their ids (module docstring)

    def __post_init__(self) -> None:
        given = [n for n in ("prompt", "messages", "input_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ProtocolError(
                f"a generate job needs exactly one of prompt, messages, input_ids; got {given}"
            )
        if self.tools is not None and self.messages is None:
            raise ProtocolError("tools come with a chat job (messages)")
        _check_scheduling(self.weight, self.priority)
        _check_pooling(self.pooling)
        check_tag(self.tag)

    def tokenized(self, ids: list[int]) -> TokenizedRequest:
        """This job with its prompt as token ids `ids`: what the router reads."""
        return TokenizedRequest(self.rid, self.reply_to, ids, self.sampling, self.created,
                                self.tenant, self.weight, priority=self.priority, v=self.v,
                                bundle_replies=self.bundle_replies, pooling=self.pooling,
                                tag=self.tag, text_only=self.text_only)  # fmt: skip


@dataclass
class TokenizedRequest(_Job):
    """A token-id job. ``attempts`` counts the workers that were handed it and died before
    finishing it (the reaper adds them when it requeues the job; jobs/job_failures.py): past
    ``max_deliveries`` the job is set aside instead of killing another worker. ``progress``
    holds the output ids those workers published (jobs/progress.py): the worker that gets
    the job continues after them. ``route_reason`` and ``expected_cached`` are the router's:
    why it chose the worker, and the prompt tokens it expected the worker's prefix cache to
    hold (stages/router/kv_routing.py); the worker reports them in the job's Finish."""

    KIND = "tokenized"
    FIELDS = {
        "rid": STR, "reply_to": STR, "input_ids": IDS, "sampling": MAP, "created": FLOAT,
        "tenant": STR, "weight": FLOAT, "attempts": INT, "priority": INT, "v": INT,
        "progress": IDS, "bundle_replies": BOOL, "route_reason": STR, "expected_cached": INT,
        "pooling": STR, "tag": INT, "text_only": BOOL,
    }  # fmt: skip
    OPTIONAL = frozenset(FIELDS) - {"rid", "reply_to", "input_ids", "sampling"}

    rid: str
    reply_to: str
    input_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    created: float | None = None
    tenant: str | None = None  # as the GenerateRequest's
    weight: float | None = None
    attempts: int | None = None
    priority: int | None = None  # as the GenerateRequest's
    v: int = JOB_VERSION
    progress: list[int] | None = None  # output ids already published, by workers that died
    bundle_replies: bool | None = None  # as the GenerateRequest's
    route_reason: str | None = None  # set by the router
    expected_cached: int | None = None
    pooling: str | None = None  # as the GenerateRequest's
    tag: int | None = None  # as the GenerateRequest's
    text_only: bool | None = None  # as the GenerateRequest's

    def __post_init__(self) -> None:
        _check_scheduling(self.weight, self.priority)
        _check_pooling(self.pooling)
        check_tag(self.tag)
        if self.attempts is not None and not 0 <= self.attempts < 2**31:
            raise ProtocolError(f"attempts must be a count >= 0; got {self.attempts}")


def _check_scheduling(weight: float | None, priority: int | None) -> None:
    # A share: zero, negative or infinite would stall or starve the tenant's queue.
    if weight is not None and not 0 < weight < float("inf"):
        raise ProtocolError(f"weight must be a positive finite number; got {weight}")
    problem = None if priority is None else check_priority(PRIORITY, priority)
    if problem is not None:
        raise ProtocolError(problem, field=PRIORITY)


def check_tag(tag: int | None) -> None:
    """A job's or a reply's ``tag``: a number from 0 to `MAX_TAG`, or none."""
    if tag is not None and not 0 <= tag <= MAX_TAG:
        raise ProtocolError(f"tag must be 0 to {MAX_TAG}; got {tag}", field="tag")


def _check_pooling(pooling: str | None) -> None:
    if pooling is not None and pooling not in POOLINGS:
        raise ProtocolError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}",
                            field="pooling")  # fmt: skip


@dataclass
class Abort(Message):
    KIND = "abort"
    FIELDS = {"rid": STR}

    rid: str
