"""OpenAI's tool calling, the answer side: the calls in a model's text, as it streams.

The model writes calls in the Hermes format (jobs/tool_format.py). Text outside the
``<tool_call>`` blocks is the message's content; a text that may be the start of a block is
held back until it is known not to be. A block whose JSON parses to a known tool's name and
object arguments is a call, sent whole in one ``delta.tool_calls`` entry (id, name and all
its arguments: the openai client accumulates either way); a block that does not is left in
the content, as the model wrote it, unless a call was parsed before it: once there are calls
the content holds no call markup, so a block cut off by ``max_tokens`` after them (a
parallel call the model had begun) is dropped rather than left dangling. Call ids are made
from the request id, so a resumed stream (Last-Event-ID) gives the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jobs.tool_format import CALL_CLOSE, CALL_OPEN
from jobs.unicode_text import check_unicode


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def entry(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class ToolCallParser:
    """Splits one choice's text into content and calls, piece by piece."""

    def __init__(self, names: set[str], id_prefix: str) -> None:
        self.names = names
        self.id_prefix = id_prefix
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet classified
        self._inside = False  # between CALL_OPEN and CALL_CLOSE
        self._blank = ""  # whitespace held back: it may be the lead-in to a call
        self._after_call = False  # no content since the last call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """(content, calls) this piece completes; `final` flushes what was held back."""
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                end = self._pending.find(CALL_CLOSE)
                if end < 0:
                    if final:  # the model stopped before closing: its JSON may be whole
                        self._content(self._block(self._pending, calls, closed=False), content)
                        self._pending, self._inside = "", False
                    break
                self._content(self._block(self._pending[:end], calls, closed=True), content)
                self._pending = self._pending[end + len(CALL_CLOSE) :]
                self._inside = False
                continue
            start = self._pending.find(CALL_OPEN)
            if start >= 0:
                self._content(self._pending[:start], content)
                self._blank = ""  # the line break before a call is not content
                self._pending = self._pending[start + len(CALL_OPEN) :]
                self._inside = True
                continue
            keep = 0 if final else _partial_suffix(self._pending, CALL_OPEN)
            self._content(self._pending[: len(self._pending) - keep], content)
            self._pending = self._pending[len(self._pending) - keep :]
            break
        if final and not self.calls:
            content.append(self._blank)  # a text without calls keeps its every character
        return "".join(content), calls

    def _content(self, text: str, out: list[str]) -> None:
        """Text outside calls; whitespace at its end waits: a call may follow it."""
        text = self._blank + text
        if self._after_call:
            text = text.lstrip()  # nor is the line break after one
            self._after_call = not text
        kept = text.rstrip()
        self._blank = text[len(kept) :]
        out.append(kept)

    def _block(self, body: str, calls: list[ToolCall], closed: bool) -> str:
        """The content a block leaves: nothing if it is a call or follows one, else itself."""
        call = self._call(body)
        if call is None:
            if self.calls:
                return ""  # markup after calls (one cut off, most likely) is not content
            return CALL_OPEN + body + (CALL_CLOSE if closed else "")
        self.calls.append(call)
        calls.append(call)
        self._after_call = True
        return ""

    def _call(self, body: str) -> ToolCall | None:
        # What the model wrote may nest past the decoder's depth, or escape a lone surrogate
        # that no reply could encode: then it is no call, and its text goes out as content.
        try:
            data = json.loads(body)
            check_unicode(data, body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(data, dict) or data.get("name") not in self.names:
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                text, arguments = arguments, json.loads(arguments)
                check_unicode(arguments, text)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        call_id = f"call_{self.id_prefix}_{len(self.calls)}"
        return ToolCall(call_id, data["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
