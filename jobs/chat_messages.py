"""A chat as its template gets it: the messages checked, and the tools placed.

The model's tokenizer (jobs/model_tokenizer.py) calls this before its jinja template
renders a chat, for every door (the engine's prompts, the tokenizer stage), so a chat is
refused, and its tools are given, alike whichever door it came in by. Every mistake is a
FieldError naming the message it is about.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jobs.field_error import FieldError
from jobs.tool_format import messages_with_tools, template_knows_tools


def template_input(
    chat_template: str | None, messages: Any, tools: Sequence[Mapping[str, Any]] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages to render and the template's extra variables (``tools``, where the
    template renders them itself; otherwise the tools, and earlier calls and results, become
    the Hermes text of jobs/tool_format.py, so the model still sees them)."""
    if chat_template is None:
        message = "messages: this model has no chat template; send a prompt instead"
        raise FieldError("messages", message)
    chat = checked_messages(messages)
    tool_list = [dict(tool) for tool in tools] if tools else []
    if template_knows_tools(chat_template):
        return chat, ({"tools": tool_list} if tool_list else {})
    if tool_list or any(m["role"] == "tool" or m.get("tool_calls") for m in chat):
        try:
            return messages_with_tools(chat, tool_list), {}
        except (KeyError, TypeError, AttributeError) as exc:  # a direct job's own shape
            message = "tools, messages: a tool call needs {function: {name, arguments}}"
            raise FieldError("messages", f"{message} ({exc!r})") from exc
    return chat, {}


def template_error(exc: Exception) -> FieldError:
    """What a template's own exception means for the request: the template is code shipped
    with the model and fed by the client, so whatever it raises is this chat's error."""
    return FieldError("messages", f"messages: the chat template rejected them: {exc}")


def checked_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as a list of dicts, each with a string ``role`` and ``content``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        message = "messages: expected a non-empty list of {role, content} objects"
        raise FieldError("messages", message)
    chat = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise FieldError(where, f"{where}: each message needs a 'role' and a 'content'")
        for key in ("role", "content"):
            if not isinstance(message[key], str):
                raise FieldError(f"{where}.{key}", f"{where}.{key}: must be a string")
        # As transformers does: templates handle a missing key better than a None value.
        chat.append({key: value for key, value in message.items() if value is not None})
    return chat
