"""A batch's input file read into its lines, as OpenAI's Batch API defines them.

Each non-empty line is one JSON object ``{"custom_id", "method": "POST", "url", "body"}``
whose url is the batch's endpoint. A line that is not such an object, or repeats an earlier
line's ``custom_id``, or is longer than a request may be (``max_batch_line_bytes``), becomes
a `LineError`: it goes to the batch's error file and the batch goes on without it. Only a
file that cannot be a batch at all (not UTF-8, more lines than the limit, no line) fails the
batch as a whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jobs.errors import RequestError
from jobs.unicode_text import check_unicode

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class BatchLine:
    line: int  # 1-based, in the input file
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    line: int
    custom_id: str | None
    code: str
    message: str


def check_endpoint(endpoint: Any) -> str:
    if endpoint not in ENDPOINTS:
        raise RequestError(400, f"endpoint must be one of {list(ENDPOINTS)}; got {endpoint!r}",
                           param="endpoint", code="invalid_value")  # fmt: skip
    return endpoint


def parse_input(
    content: bytes, endpoint: str, max_lines: int, max_line_bytes: int
) -> tuple[list[BatchLine], list[LineError]]:
    """The file's good lines and its bad ones; RequestError if it cannot be a batch."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"the input file is not UTF-8 JSONL: {exc}",
                           param="input_file_id", code="invalid_file") from None  # fmt: skip
    numbered = [(n, raw) for n, raw in enumerate(text.splitlines(), start=1) if raw.strip()]
    if not numbered:
        raise RequestError(400, "the input file has no lines", param="input_file_id",
                           code="invalid_file")  # fmt: skip
    if len(numbered) > max_lines:
        raise RequestError(400, f"the input file has {len(numbered)} lines; a batch takes at "
                           f"most {max_lines}", param="input_file_id",
                           code="too_many_lines")  # fmt: skip
    lines: list[BatchLine] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for n, raw in numbered:
        size = len(raw.encode())
        if size > max_line_bytes:  # not parsed: a line skips no bound a request has
            parsed: BatchLine | LineError = LineError(
                n, None, "line_too_large",
                f"line {n} has {size} bytes; a line may have at most {max_line_bytes} "
                "(max_batch_line_bytes)")  # fmt: skip
        else:
            parsed = _parse_line(n, raw, endpoint)
        if isinstance(parsed, BatchLine) and parsed.custom_id in seen:
            parsed = LineError(n, parsed.custom_id, "duplicate_custom_id",
                               f"custom_id {parsed.custom_id!r} is on an earlier line")  # fmt: skip
        if isinstance(parsed, BatchLine):
            seen.add(parsed.custom_id)
            lines.append(parsed)
        else:
            errors.append(parsed)
    return lines, errors


def _parse_line(n: int, raw: str, endpoint: str) -> BatchLine | LineError:
    try:
        obj = json.loads(raw)
        check_unicode(obj, raw)
    except (ValueError, RecursionError) as exc:  # NotUnicode is a ValueError
        return LineError(n, None, "invalid_json", f"line {n} is not JSON: {exc}")
    if not isinstance(obj, dict):
        return LineError(n, None, "invalid_request", f"line {n} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(n, None, "missing_custom_id", f"line {n} has no custom_id string")
    if obj.get("method", "POST") != "POST":
        return LineError(n, custom_id, "invalid_method",
                         f"method must be POST; got {obj.get('method')!r}")  # fmt: skip
    if obj.get("url") != endpoint:
        message = f"url {obj.get('url')!r} is not the batch's endpoint {endpoint}"
        return LineError(n, custom_id, "mismatched_url", message)
    body = obj.get("body")
    if not isinstance(body, dict):
        return LineError(n, custom_id, "invalid_body", "body must be a JSON object")
    if body.get("stream"):
        return LineError(n, custom_id, "invalid_body", "a batch line cannot be streamed")
    return BatchLine(n, custom_id, body)
