"""What a worker says of one request in one step: `TokenItem` (its new tokens, with the
context a detokenizer needs) and, on the last, `Finish` (how it ended, with its counts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobs.wire import BOOL, IDS, INT, STR, ProtocolError, check_field, pack_ids

# Prompt tokens decoded as context for the first output tokens (vLLM and SGLang use 5).
PROMPT_CONTEXT_TOKENS = 5


@dataclass
class Finish:
    """How a request ended: ``reason`` is stop, length, abort or error."""

    reason: str
    matched: str | int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Speculative decoding: tokens drafted for the request, and how many were accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Seconds from the job's creation to the start of the step that computed its first
    # token (None: not measured, e.g. a job that finished before it ran).
    queue_seconds: float | None = None

    def to_wire(self) -> list[Any]:
        wire = [
            self.reason, self.matched, self.prompt_tokens, self.completion_tokens,
            self.cached_tokens,
        ]  # fmt: skip
        # Without speculation or timing, the 5 fields older readers expect.
        if self.draft_tokens or self.queue_seconds is not None:
            wire += [self.draft_tokens, self.accepted_draft_tokens]
        if self.queue_seconds is not None:
            wire.append(self.queue_seconds)
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> Finish:
        if not isinstance(data, list) or len(data) not in (5, 7, 8):
            raise ProtocolError("field 'finish' must be a list of 5, 7 or 8")
        reason, matched, *counts = data
        check_field(STR, "finish.reason", reason, optional=False)
        if matched is not None and not isinstance(matched, (str, int)):
            raise ProtocolError("field 'finish.matched' must be str, int or nil")
        names = ("prompt", "completion", "cached", "draft", "accepted_draft")
        for name, value in zip(names, counts, strict=False):
            check_field(INT, f"finish.{name}_tokens", value, optional=False)
        if len(counts) == 6 and (
            isinstance(counts[5], bool) or not isinstance(counts[5], (int, float))
        ):
            raise ProtocolError("field 'finish.queue_seconds' must be a number")
        return cls(reason, matched, *counts)

    def usage(self) -> dict[str, int]:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if self.draft_tokens:
            usage.update(draft_tokens=self.draft_tokens,
                         accepted_draft_tokens=self.accepted_draft_tokens)  # fmt: skip
        return usage


@dataclass
class TokenItem:
    """One request's new tokens in one engine step.

    ``start`` is the output index of ``ids[0]``. ``context`` is the token ids just before
    ``ids`` (the last prompt tokens, then earlier output), of which the first
    ``prompt_context`` are prompt tokens: with them a detokenizer replica that has never seen
    this request turns ``ids`` into exactly the text they add (see
    stages/detokenizer/incremental.py).
    """

    rid: str
    reply_to: str
    start: int
    ids: list[int]
    context: list[int]
    prompt_context: int
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    finish: Finish | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[list[float]]] | None = None  # per token: [[id, logprob], ...]
    # The prompt and its logprobs (sampling's prompt_logprobs), on a request's first item:
    # one entry per prompt token, None for the first.
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[list[float]] | None] | None = None

    def to_wire(self) -> list[Any]:
        prompt = None
        if self.prompt_ids is not None:
            prompt = [pack_ids(self.prompt_ids), self.prompt_logprobs, self.prompt_top_logprobs]
        return [
            self.rid, self.reply_to, self.start, pack_ids(self.ids), pack_ids(self.context),
            self.prompt_context, self.stop, self.skip_special_tokens,
            None if self.finish is None else self.finish.to_wire(),
            self.logprobs, self.top_logprobs, prompt,
        ]  # fmt: skip

    @classmethod
    def from_wire(cls, data: Any) -> TokenItem:
        # 11 fields from a worker that predates prompt logprobs (a rolling upgrade).
        if not isinstance(data, list) or len(data) not in (11, 12):
            raise ProtocolError("a token item must be a list of 12")
        prompt = data[11] if len(data) == 12 else None
        rid, reply_to, start, ids, context, prompt_context, stop, skip, finish, lps, tops = data[
            :11
        ]
        check_field(STR, "rid", rid, False)
        check_field(STR, "reply_to", reply_to, False)
        check_field(INT, "start", start, False)
        check_field(INT, "prompt_context", prompt_context, False)
        check_field(BOOL, "skip_special_tokens", skip, False)
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ProtocolError("field 'stop' must be a list of strings")
        if lps is not None and not isinstance(lps, list):
            raise ProtocolError("field 'logprobs' must be a list")
        if tops is not None and not isinstance(tops, list):
            raise ProtocolError("field 'top_logprobs' must be a list")
        item = cls(
            rid, reply_to, start, check_field(IDS, "ids", ids, False),
            check_field(IDS, "context", context, False), prompt_context, stop, skip,
            None if finish is None else Finish.from_wire(finish), lps, tops,
        )  # fmt: skip
        if not 0 <= item.prompt_context <= len(item.context):
            raise ProtocolError("field 'prompt_context' exceeds the context")
        if prompt is not None:
            if not isinstance(prompt, list) or len(prompt) != 3:
                raise ProtocolError("field 'prompt' must be [ids, logprobs, top_logprobs]")
            item.prompt_ids = check_field(IDS, "prompt_ids", prompt[0], False)
            for name, value in (("prompt_logprobs", prompt[1]), ("prompt_top_logprobs", prompt[2])):
                if value is not None and not isinstance(value, list):
                    raise ProtocolError(f"field {name!r} must be a list")
            item.prompt_logprobs, item.prompt_top_logprobs = prompt[1], prompt[2]
        return item


def token_context(
    prompt_ids: list[int], output_ids: list[int], start: int, window: int
) -> tuple[list[int], int]:
    """(context, prompt_context) of a TokenItem whose ids begin at output index `start`.

    Until `window` output tokens exist, the context is the last prompt tokens and all the
    output so far, so the first tokens decode in context and any held-back text is inside;
    after that, the `window` output tokens before `start`.
    """
    if start < window:
        prompt_part = prompt_ids[-PROMPT_CONTEXT_TOKENS:]
        return prompt_part + output_ids[:start], len(prompt_part)
    return output_ids[start - window : start], 0
