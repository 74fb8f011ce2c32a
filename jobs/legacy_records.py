"""Wire version 1 of the token records: positional lists whose length said what they held.

Workers before version 2 send a token item as a list of 11 (12 once prompt logprobs came)
with its finish a list of 5 (7 with draft counts, 8 with the queue time); clients before
version 2 read a delta's ``finish`` as that list. This module reads those lists into the
fields of jobs/token_records.py's records, and writes a finish as one for a version-1
reader, so a rolling upgrade and an older direct client keep working.
"""

from __future__ import annotations

from typing import Any

from jobs.wire import BOOL, IDS, INT, STR, ProtocolError, check_field

_FINISH_COUNTS = ("prompt", "completion", "cached", "draft", "accepted_draft")


def finish_fields_from_list(data: list[Any]) -> dict[str, Any]:
    """A version-1 finish's fields by name."""
    if len(data) not in (5, 7, 8):
        raise ProtocolError("field 'finish' must be a list of 5, 7 or 8")
    reason, matched, *counts = data
    check_field(STR, "finish.reason", reason, optional=False)
    if matched is not None and not isinstance(matched, (str, int)):
        raise ProtocolError("field 'finish.matched' must be str, int or nil")
    fields: dict[str, Any] = {"reason": reason, "matched": matched}
    for name, value in zip(_FINISH_COUNTS, counts, strict=False):
        fields[f"{name}_tokens"] = check_field(INT, f"finish.{name}_tokens", value, optional=False)
    if len(counts) == 6:
        if isinstance(counts[5], bool) or not isinstance(counts[5], (int, float)):
            raise ProtocolError("field 'finish.queue_seconds' must be a number")
        fields["queue_seconds"] = counts[5]
    return fields


def finish_as_list(finish: Any) -> list[Any]:
    """A `Finish` as a version-1 reader expects it: 5 fields, 7 with draft counts, 8 timed."""
    wire = [
        finish.reason, finish.matched, finish.prompt_tokens, finish.completion_tokens,
        finish.cached_tokens,
    ]  # fmt: skip
    if finish.draft_tokens or finish.queue_seconds is not None:
        wire += [finish.draft_tokens, finish.accepted_draft_tokens]
    if finish.queue_seconds is not None:
        wire.append(finish.queue_seconds)
    return wire


def token_item_fields_from_list(data: list[Any]) -> dict[str, Any]:
    """A version-1 token item's fields by name (its finish still a list)."""
    # 11 fields from a worker that predates prompt logprobs.
    if len(data) not in (11, 12):
        raise ProtocolError("a version-1 token item must be a list of 11 or 12")
    rid, reply_to, start, ids, context, prompt_context, stop, skip, finish, lps, tops = data[:11]
    fields = {
        "rid": check_field(STR, "rid", rid, False),
        "reply_to": check_field(STR, "reply_to", reply_to, False),
        "start": check_field(INT, "start", start, False),
        "ids": check_field(IDS, "ids", ids, False),
        "context": check_field(IDS, "context", context, False),
        "prompt_context": check_field(INT, "prompt_context", prompt_context, False),
        "skip_special_tokens": check_field(BOOL, "skip_special_tokens", skip, False),
        "finish": finish, "reply_version": 1,
    }  # fmt: skip
    if not isinstance(stop, list):
        raise ProtocolError("field 'stop' must be a list of strings")
    fields["stop"] = stop
    for name, value in (("logprobs", lps), ("top_logprobs", tops)):
        if value is not None and not isinstance(value, list):
            raise ProtocolError(f"field {name!r} must be a list")
        fields[name] = value
    prompt = data[11] if len(data) == 12 else None
    if prompt is not None:
        if not isinstance(prompt, list) or len(prompt) != 3:
            raise ProtocolError("field 'prompt' must be [ids, logprobs, top_logprobs]")
        fields["prompt_ids"] = check_field(IDS, "prompt_ids", prompt[0], False)
        for name, value in (("prompt_logprobs", prompt[1]), ("prompt_top_logprobs", prompt[2])):
            if value is not None and not isinstance(value, list):
                raise ProtocolError(f"field {name!r} must be a list")
            fields[name] = value
    return fields
