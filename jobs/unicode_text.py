"""Strings from a user's JSON that are Unicode: no lone surrogate.

JSON may escape a UTF-16 surrogate on its own (``"\\ud800"``): valid JSON, but not a
character. Python decodes it into a str that UTF-8 cannot encode, and so msgpack, redis-py
and every JSON reply refuse it at the first place they pack the request: a request that
held one was a 500 of the ingress (chat, completions, responses, embeddings), and a batch
line or a tool call's arguments failed far from their cause. Each door that parses a
user's JSON checks what it parsed here, and answers a lone surrogate as the request's error,
naming where it is.

A surrogate pair (``"\\ud83d\\ude00"``, how many JSON encoders write an emoji) decodes to
one character and passes. The check walks the parsed value only when the text holds a
surrogate's escape at all, so a body without one costs a regular expression search.
"""

from __future__ import annotations

import re
from typing import Any

# A \u escape of a surrogate (U+D800-U+DFFF); a backslash escaped before it may make this a
# false alarm, which only costs the walk.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class NotUnicode(ValueError):
    """A string of the parsed value holds a lone surrogate; `where` names it (``a.b[2]``,
    empty for the value itself)."""

    def __init__(self, where: str, char: str) -> None:
        self.where = where
        place = f"{where} is" if where else "the value is"
        super().__init__(f"{place} not valid Unicode: it holds a lone surrogate \\u{ord(char):04x}")


def check_unicode(value: Any, text: str) -> None:
    """Raise NotUnicode if a string of `value` (a key or a value, at any depth), parsed from
    the JSON `text`, holds a lone surrogate."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return  # no escape of one, and a raw surrogate cannot come through a strict decode
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:  # by hand, not recursion: nesting is bounded only by the decoder
        item, where = stack.pop()
        if isinstance(item, str):
            check_string(item, where)
        elif isinstance(item, dict):
            for key, member in item.items():
                check_string(key, where)
                stack.append((member, f"{where}.{key}" if where else key))
        elif isinstance(item, list):
            stack.extend((member, f"{where}[{i}]") for i, member in enumerate(item))


def check_string(text: str, where: str) -> None:
    """Raise NotUnicode (naming `where`) if `text` holds a lone surrogate, however it came:
    an escape, or bytes that are not UTF-8 handed on as surrogates (surrogateescape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise NotUnicode(where, text[exc.start]) from None
