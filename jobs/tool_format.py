"""How tool calls look in the model's text: the Hermes format.

A call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>`` lines; a tool's result goes back as ``<tool_response>`` text. Qwen2.5,
Hermes and SmolLM3 are trained on it and their chat templates render tools this way, so it is
the one format the ingress parses, and the one its grammar for tool_choice ``required``
forces. A chat template that knows nothing of tools (SmolLM2's) gets them as this module's
system prompt, and the conversation's earlier calls and results as this format's text, so
the model still sees them.
"""

from __future__ import annotations

import json
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

_SYSTEM_PROMPT = """\
You may call one or more functions to answer the user. The functions, as JSON Schema \
signatures, are:
<tools>
{tools}
</tools>
To call a function, answer with a JSON object holding its name and arguments between \
tags, one block per call:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def template_knows_tools(template: str) -> bool:
    """Whether a chat template renders the ``tools`` it is given (Hub templates that do name
    the variable; one that does not would drop them)."""
    return "tools" in template


def messages_with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list:
    """`messages` for a template that knows nothing of tools: the tools (if any) in the system
    message, earlier calls in the assistant's text, results as user turns."""
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"])
                     for c in message["tool_calls"]]  # fmt: skip
            content = "\n".join([content, *calls] if content else calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if not tools:
        return out
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    prompt = _SYSTEM_PROMPT.format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out
