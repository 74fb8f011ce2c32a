"""OpenAI's response shapes: whole bodies, stream chunks, usage and logprobs.

`ChatFormat` and `CompletionFormat` share one interface, so the handler that relays replies
is the same for both endpoints. A `Choice` accumulates what one sub-request produced.

Top logprobs come as token ids; their texts come from the delta's ``top_token_texts`` when
the detokenizer sends it, else the chosen token's text where the id is the chosen one, else
``"<id>"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jobs.protocol import Finish, TextDelta
from stages.ingress.api.tool_call_parser import ToolCallParser


@dataclass
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0  # output tokens so far (its deltas' counts)
    finish: Finish | None = None
    text_offset: int = 0  # characters so far, for completions' text_offset
    logprobs: dict[str, list] | None = None  # the whole response's logprobs, accumulated
    tool_parser: ToolCallParser | None = None  # a chat that may call tools
    weights_version: str | None = None  # named by its first delta (and again by its Finish)

    @property
    def finish_reason(self) -> str | None:
        reason = None if self.finish is None else self.finish.reason
        if reason == "stop" and self.tool_parser is not None and self.tool_parser.calls:
            return "tool_calls"  # as OpenAI: the model stopped to have its calls run
        return reason

    def add(self, delta: TextDelta) -> None:
        self.add_text(delta.text, delta.count)
        self.named(delta)
        if delta.finish is not None:
            self.finish = delta.finish_info()

    def add_text(self, text: str | None, tokens: int) -> None:
        """What a delta of text alone adds (all `add` does for one)."""
        self.text.append(text or "")
        self.tokens += tokens

    def named(self, delta: TextDelta) -> None:
        """Keep the weights version a delta names (a request's first one does)."""
        if delta.weights_version is not None and self.weights_version is None:
            self.weights_version = delta.weights_version


def token_texts(delta: TextDelta) -> list[str]:
    if delta.token_texts is not None and len(delta.token_texts) == len(delta.ids):
        return delta.token_texts
    return [f"<{token}>" for token in delta.ids]


def top_entries(delta: TextDelta) -> list[list[tuple[str, float]]]:
    """Per token, its top alternatives as (text, logprob)."""
    tops = delta.top_logprobs or [[] for _ in delta.ids]
    texts = token_texts(delta)
    explicit = getattr(delta, "top_token_texts", None)  # a field the detokenizer may add
    out = []
    for i, alternatives in enumerate(tops):
        row = []
        for j, (token, logprob) in enumerate(alternatives):
            if explicit is not None:
                text = explicit[i][j]
            elif i < len(delta.ids) and int(token) == delta.ids[i]:
                text = texts[i]
            else:
                text = f"<{int(token)}>"
            row.append((text, float(logprob)))
        out.append(row)
    return out


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Prompt tokens once per prompt (the first of its n choices), completion tokens of all."""
    finishes = [c.finish for c in choices if c.finish is not None]
    firsts = [c.finish for c in choices if c.finish is not None and c.index % n == 0]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(f.completion_tokens for f in finishes)
    result: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)},
    }
    drafted = sum(f.draft_tokens for f in finishes)
    if drafted:
        # Speculative drafts, in the fields OpenAI gives its predicted outputs.
        accepted = sum(f.accepted_draft_tokens for f in finishes)
        result["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return result


def system_fingerprint(choices: list[Choice]) -> str | None:
    """The weights that answered (jobs/weights.py): the version each choice's Finish names.
    A worker swaps weights only with nothing running, so one version computed each choice;
    choices served by workers on different versions (mid-update) name each, in order."""
    if len(choices) == 1:  # a stream's chunk, each of its events
        c = choices[0]
        return (c.finish.weights_version if c.finish is not None else c.weights_version) or None
    versions = [
        c.finish.weights_version if c.finish is not None else c.weights_version for c in choices
    ]
    named = list(dict.fromkeys(v for v in versions if v))
    return ",".join(named) if named else None


def choice_entry(
    index: int, content: dict[str, Any], logprobs: dict | None, finish_reason: str | None
) -> dict[str, Any]:
    """One entry of a response's or a chunk's "choices": the index, what the format puts
    there (chat's message or delta, completions' text), then logprobs and finish_reason."""
    return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}


class ChatFormat:
    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    whole_object = "chat.completion"

    def first_chunk_choices(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return [
            {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for c in choices
        ]

    def logprobs(self, choice: Choice, delta: TextDelta) -> dict[str, Any]:
        """This delta's part; also appended to the choice's whole."""
        content = [
            {
                "token": text,
                "logprob": float(logprob),
                "bytes": _bytes(text),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in top],
            }
            for text, logprob, top in zip(
                token_texts(delta), delta.logprobs or [], top_entries(delta), strict=False
            )
        ]
        if choice.logprobs is None:
            choice.logprobs = {"content": []}
        choice.logprobs["content"].extend(content)
        return {"content": content}

    def delta(self, choice: Choice, text: str, final: bool) -> dict[str, Any]:
        """What a piece of the choice's text adds to the message: content, tool calls."""
        if choice.tool_parser is None:
            return {"content": text} if text else {}
        first = len(choice.tool_parser.calls)
        content, calls = choice.tool_parser.feed(text, final)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [call.entry(first + i) for i, call in enumerate(calls)]
        return delta

    def chunk_choice(
        self, choice: Choice, delta: dict[str, Any], logprobs: dict | None,
        finish_reason: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        return choice_entry(choice.index, {"delta": delta}, logprobs, finish_reason)

    def whole_choice(self, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.text)}
        if choice.tool_parser is not None:
            whole = self.delta(choice, message["content"], final=True)
            message["content"] = whole.get("content")
            if choice.tool_parser.calls:
                message["tool_calls"] = whole["tool_calls"]
        return choice_entry(
            choice.index, {"message": message}, choice.logprobs, choice.finish_reason
        )


class CompletionFormat:
    id_prefix = "cmpl-"
    chunk_object = "text_completion"
    whole_object = "text_completion"

    def first_chunk_choices(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return []

    def logprobs(self, choice: Choice, delta: TextDelta) -> dict[str, Any]:
        lps = [float(lp) for lp in delta.logprobs or []]
        return self._part(choice, token_texts(delta), lps, [dict(r) for r in top_entries(delta)])

    def echo(
        self, choice: Choice, delta: TextDelta, prompt: str | None, logprobs: bool
    ) -> tuple[str, dict[str, Any] | None]:
        """The prompt before the completion: its text (the request's own, else decoded) and,
        with `logprobs`, its tokens' part of the logprobs (None for the first token, as
        OpenAI). `delta` is the one carrying the prompt."""
        text = prompt if prompt is not None else delta.prompt_text or ""
        choice.text.append(text)
        if not logprobs:
            return text, None
        texts = delta.prompt_token_texts or [f"<{t}>" for t in delta.prompt_ids or []]
        top_texts = delta.prompt_top_token_texts or []
        tops = [
            None if row is None else {
                (top_texts[i][j] if i < len(top_texts) and top_texts[i] else f"<{int(token)}>"): lp
                for j, (token, lp) in enumerate(row)
            }
            for i, row in enumerate(delta.prompt_top_logprobs or [None] * len(texts))
        ]  # fmt: skip
        return text, self._part(choice, texts, list(delta.prompt_logprobs or []), tops)

    def _part(self, choice: Choice, texts: list[str], logprobs: list, tops: list) -> dict[str, Any]:
        """These tokens' logprobs, in the shape of completions'; also appended to the
        choice's whole."""
        offsets = []
        for text in texts:
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
        part = {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip
        if choice.logprobs is None:
            choice.logprobs = {key: [] for key in part}
        for key, values in part.items():
            choice.logprobs[key].extend(values)
        return part

    def delta(self, choice: Choice, text: str, final: bool) -> dict[str, Any]:
        return {"text": text} if text else {}

    def chunk_choice(
        self, choice: Choice, delta: dict[str, Any], logprobs: dict | None,
        finish_reason: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        return choice_entry(choice.index, {"text": delta.get("text", "")}, logprobs, finish_reason)

    def whole_choice(self, choice: Choice) -> dict[str, Any]:
        text = {"text": "".join(choice.text)}
        return choice_entry(choice.index, text, choice.logprobs, choice.finish_reason)


OpenAIFormat = ChatFormat | CompletionFormat


# Per-request figures (seconds) as response headers: what a client of the OpenAI routes gets
# of the native meta_info's queue_time, ttft and decode_time.
TIMING_HEADERS = {"queue_time": "X-Streamserve-Queue-Time", "ttft": "X-Streamserve-TTFT",
                  "decode_time": "X-Streamserve-Decode-Time"}  # fmt: skip


def timing_headers(figures: dict[str, float]) -> dict[str, str]:
    return {TIMING_HEADERS[name]: f"{value:.6f}" for name, value in figures.items()}
