"""A response's input as OpenAI's items: ``GET /v1/responses/{id}/input_items``.

The items are the create body's ``input`` (kept with the response, store.py), each with
the fields OpenAI's item objects have: a message's text parts (``input_text``, or
``output_text`` for an assistant's), a function call, a function call's output. An item
without an id gets one from the response id and its place, so the same one is named the
same on every read. Listed as OpenAI lists them: newest first unless ``order=asc``,
``limit`` (1 to 100, 20 by default) at a time, ``after`` an item id.
"""

from __future__ import annotations

from typing import Any

from batch_store.files import check_limit, list_object
from jobs.errors import RequestError

ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
MAX_LIMIT = 100


def input_items(raw: Any, response_id: str) -> list[dict[str, Any]]:
    """The items of a create body's `raw` input, in order."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    base = response_id.removeprefix("resp_")
    items = []
    for i, item in enumerate(raw or []):
        kind = item.get("type", "message")
        entry: dict[str, Any] = {"id": item.get("id") or f"{ID_PREFIXES[kind]}_{base}_in{i}",
                                 "type": kind, "status": "completed"}  # fmt: skip
        if kind == "message":
            entry.update(role=item["role"], content=_parts(item["role"], item["content"]))
        else:
            entry.update({k: item[k] for k in ("call_id", "name", "arguments", "output")
                          if k in item})  # fmt: skip
        items.append(entry)
    return items


def _parts(role: str, content: Any) -> list[dict[str, Any]]:
    kind = "output_text" if role == "assistant" else "input_text"
    texts = [content] if isinstance(content, str) else [p.get("text") or "" for p in content]
    extra = {"annotations": []} if kind == "output_text" else {}
    return [{"type": kind, "text": text, **extra} for text in texts]


def page(items: list[dict[str, Any]], order: str, after: str | None, limit: int) -> dict:
    """One page of `items`, as OpenAI's list object."""
    if order not in ("asc", "desc"):
        raise RequestError(400, f"order must be asc or desc; got {order!r}", param="order")
    check_limit(limit, MAX_LIMIT)
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise RequestError(400, f"after: no input item {after!r}", param="after")
        start = ids.index(after) + 1
    chosen = ordered[start : start + limit]
    return list_object(chosen, start + limit < len(ordered))
