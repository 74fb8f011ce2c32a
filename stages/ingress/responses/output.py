"""A Response object as the chat job's replies build it, and the stream events on the way.

`ResponseBuilder` takes the job's replies one by one and returns the events each one makes,
in OpenAI's order: ``response.created`` and ``response.in_progress`` first; for the answer's
text a ``message`` item (``output_item.added``, ``content_part.added``, then one
``output_text.delta`` per piece of text, and at the end ``output_text.done``,
``content_part.done``, ``output_item.done``); for each tool call the model makes a
``function_call`` item (added, its arguments whole in one delta, done); and last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it, or it
was aborted: then its status is ``cancelled``; ``response.failed`` on an error). Each event has its
``sequence_number``. A whole answer is the same object without the events.

Calls are parsed from the text as chat's are (api/tool_call_parser.py); their ids come from
the response id, as the items' ids do, so the stored object and the stream agree, and a
stream replayed from the same replies (resume.py) is the same events.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from jobs.protocol import TextDelta
from stages.ingress.api.openai_format import Choice, usage
from stages.ingress.api.tool_call_parser import ToolCall, ToolCallParser
from stages.ingress.errors import ApiError

# A finish reason -> the response's status (any other: incomplete). An abort is a cancel:
# POST /v1/responses/{id}/cancel, or /v1/abort/{id}.
FINISH_STATUS = {"stop": "completed", "tool_calls": "completed", "abort": "cancelled"}
# An error's status -> the code OpenAI's ResponseError has for it.
ERROR_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def response_usage(choice: Choice) -> dict[str, Any]:
    chat = usage([choice], 1)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def response_head(response_id: str, model: str, data: dict[str, Any],
                  status: str) -> dict[str, Any]:  # fmt: skip
    """A Response object with no output yet: what the request asked, echoed as OpenAI does."""
    text = data.get("text") or {}
    tool_choice = data.get("tool_choice")
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": bool(data.get("background")),
        "error": None,
        "incomplete_details": None,
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": data.get("parallel_tool_calls") is not False,
        "previous_response_id": data.get("previous_response_id"),
        "store": data.get("store") is not False,
        "temperature": data.get("temperature"),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": "auto" if tool_choice is None else tool_choice,
        "tools": data.get("tools") or [],
        "top_p": data.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": data.get("user"),
        "metadata": data.get("metadata") or {},
    }


def error_object(error: ApiError) -> dict[str, Any]:
    code = ERROR_CODES.get(error.status, "server_error")
    return {"code": code, "message": error.message}


class ResponseBuilder:
    def __init__(self, response: dict[str, Any], tool_names: set[str] | None) -> None:
        self.response = response
        self.choice = Choice(0)
        parser_id = response["id"][-12:]
        self.tool_parser = None if tool_names is None else ToolCallParser(tool_names, parser_id)
        self.sequence = 0
        self.message: dict[str, Any] | None = None  # the open message item
        self.text: list[str] = []  # its text so far

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        # A copy: what an event shows must not change as the response goes on.
        event = {"type": kind, "sequence_number": self.sequence, **copy.deepcopy(fields)}
        self.sequence += 1
        return event

    def started(self) -> list[dict[str, Any]]:
        self.response["status"] = "in_progress"
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]  # fmt: skip

    def add(self, reply: TextDelta) -> list[dict[str, Any]]:
        """The events one reply of the job makes."""
        self.choice.add(reply)
        final = reply.finish is not None
        text, calls = reply.text or "", []
        if self.tool_parser is not None:
            text, calls = self.tool_parser.feed(text, final)
        events = self._text(text) if text else []
        for call in calls:
            events += self._call(call)
        if final:
            events += self._finish()
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.message is None:
            events = self._open_message()
        assert self.message is not None
        self.text.append(text)
        events.append(self._event("response.output_text.delta", item_id=self.message["id"],
                                  output_index=self._index(self.message), content_index=0,
                                  delta=text, logprobs=[]))  # fmt: skip
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self.message = {"id": self._item_id("msg"), "type": "message",
                        "status": "in_progress", "role": "assistant", "content": []}  # fmt: skip
        self.output.append(self.message)
        index = self._index(self.message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=index, item=self.message),
                self._event("response.content_part.added", item_id=self.message["id"],
                            output_index=index, content_index=0, part=part)]  # fmt: skip

    def _item_id(self, kind: str) -> str:
        """From the response id and the item's place: a replayed stream (resume.py) names
        its items as the first one did."""
        return f"{kind}_{self.response['id'].removeprefix('resp_')}_{len(self.output)}"

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, o in enumerate(self.output) if o is item)

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        item = {"id": self._item_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": call.id, "name": call.name, "arguments": ""}  # fmt: skip
        self.output.append(item)
        index = self._index(item)
        added = self._event("response.output_item.added", output_index=index, item=dict(item))
        item["arguments"] = call.arguments
        delta = self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=call.arguments)  # fmt: skip
        done = self._event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, arguments=call.arguments)  # fmt: skip
        item["status"] = "completed"
        return [
            added,
            delta,
            done,
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _finish(self) -> list[dict[str, Any]]:
        """Close the message (one with empty text if there is nothing else), then the
        response."""
        events = []
        if not self.output:
            events += self._open_message()
        reason = self.choice.finish_reason or ""
        status = FINISH_STATUS.get(reason, "incomplete")
        if self.message is not None:  # a message item is completed or incomplete
            events += self._close_message("completed" if status == "completed" else "incomplete")
        self.response["usage"] = response_usage(self.choice)
        self.response["status"] = status
        if reason == "length":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        # OpenAI's stream has no event of its own for a cancelled response.
        ending = "completed" if status == "completed" else "incomplete"
        events.append(self._event(f"response.{ending}", response=self.response))
        return events

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        assert self.message is not None
        item_id, index, text = self.message["id"], self._index(self.message), "".join(self.text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        self.message["content"] = [part]
        self.message["status"] = status
        self.message = None
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=index,
                            item=self.output[index])]  # fmt: skip

    def failed(self, error: ApiError) -> list[dict[str, Any]]:
        self.response["status"] = "failed"
        self.response["error"] = error_object(error)
        return [self._event("response.failed", response=self.response)]

    def history(self) -> list[dict[str, Any]]:
        """The answer as chat messages, for a later turn's previous_response_id."""
        text = "".join(self.text)
        calls = [{"id": o["call_id"], "type": "function",
                  "function": {"name": o["name"], "arguments": o["arguments"]}}
                 for o in self.output if o["type"] == "function_call"]  # fmt: skip
        if not self.output:
            return []  # nothing answered yet
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        return [message]
