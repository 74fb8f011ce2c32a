"""Turning what a caller passes to the engine into validated token-id prompts.

A caller gives exactly one of: text prompt(s), token-id prompt(s), or chat conversation(s);
and either one sampling-params dict for all requests or one per request. Every mistake is a
ValueError; one about a field is a FieldError carrying it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jobs.field_error import FieldError
from jobs.sampling_params import SamplingParamError, SamplingParams


def normalize_prompts(
    tokenizer: Any,
    vocab_size: int,
    prompt: str | Sequence[str] | None,
    input_ids: Sequence[int] | Sequence[Sequence[int]] | None,
    messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]] | None,
) -> tuple[list[list[int]], bool]:
    """Return the token ids of every prompt and whether the caller passed a single prompt."""
    given = [
        name
        for name, value in (("prompt", prompt), ("input_ids", input_ids), ("messages", messages))
        if value is not None
    ]
    if len(given) != 1:
        raise ValueError(
            "give exactly one of prompt, input_ids or messages"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if prompt is not None:
        single = isinstance(prompt, str)
        texts = [prompt] if single else list(prompt)
        if not all(isinstance(text, str) for text in texts):
            raise FieldError("prompt", "prompt must be a string or a list of strings")
        _require_tokenizer(tokenizer, "prompt")
        ids = [tokenizer.encode(text) if text else [] for text in texts]
        return checked_ids(ids, vocab_size, "prompt"), single
    if input_ids is not None:
        if not isinstance(input_ids, Sequence) or isinstance(input_ids, str):
            message = "input_ids must be a list of token ids or a list of such lists"
            raise FieldError("input_ids", message)
        single = len(input_ids) == 0 or not isinstance(input_ids[0], Sequence)
        ids = [list(input_ids)] if single else [list(seq) for seq in input_ids]
        return checked_ids(ids, vocab_size, "input_ids"), single
    _require_tokenizer(tokenizer, "messages")
    if not isinstance(messages, Sequence) or not messages:
        raise FieldError("messages", "messages must be a non-empty list of {role, content} dicts")
    single = isinstance(messages[0], Mapping)
    conversations = [messages] if single else list(messages)
    ids = [_apply_chat_template(tokenizer, conversation) for conversation in conversations]
    return checked_ids(ids, vocab_size, "messages"), single


def normalize_sampling_params(
    params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt (their ranges are checked with the request they go in)."""
    if params is None or isinstance(params, Mapping):
        return [SamplingParams.from_dict(params)] * count
    if not isinstance(params, Sequence) or len(params) != count:
        raise SamplingParamError(
            "sampling_params",
            f"sampling_params must be one dict or a list of {count} dicts (one per prompt)",
        )
    return [SamplingParams.from_dict(one) for one in params]


def _apply_chat_template(tokenizer: Any, conversation: Sequence[Mapping[str, Any]]) -> list[int]:
    for message in conversation:
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise FieldError(
                "messages", f"messages: each message needs 'role' and 'content', got {message!r}"
            )
        if not isinstance(message["content"], str):
            raise FieldError("messages", "messages: 'content' must be a string")
    if not getattr(tokenizer, "chat_template", None):
        message = "messages: this model's tokenizer has no chat template; send a prompt"
        raise FieldError("messages", message)
    text = tokenizer.apply_chat_template(
        list(conversation), tokenize=False, add_generation_prompt=True
    )
    # The template already wrote any special tokens the model expects.
    return tokenizer.encode(text, add_special_tokens=False)


def checked_ids(ids: list[list[int]], vocab_size: int, field: str) -> list[list[int]]:
    if not ids:
        raise FieldError(field, f"{field} is empty: give at least one prompt")
    for seq in ids:
        if not seq:
            raise FieldError(field, f"{field}: a prompt is empty")
        for token in seq:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                message = f"{field}: token id {token!r} is not in [0, {vocab_size})"
                raise FieldError(field, message)
    return ids


def _require_tokenizer(tokenizer: Any, field: str) -> None:
    if tokenizer is None:
        message = f"{field}: this model has no tokenizer (a random: model); send input_ids"
        raise FieldError(field, message)
