"""One request normaliser for both front doors: `Engine.generate` (in process) and the
pipeline (the tokenizer stage, then the worker's admission).

A request gives exactly one of a text ``prompt``, a chat (``messages``, with the ``tools``
it may call) or ``input_ids``, and its sampling parameters. Every door turns it into token
ids and SamplingParams with these functions, so the defaults and the checks are one:

- the prompt's shape: exactly one kind, a string / a conversation / a list of token ids
  (the engine also takes a list of them: ``many``);
- token ids are integers in ``[0, vocab_size)``: empty or out-of-range is refused;
- ``max_new_tokens`` missing means all that fit (OpenAI's missing ``max_tokens``): what the
  context, and the KV pool where known, leave after the prompt;
- prompt + ``max_new_tokens`` within the context (OpenAI's ``context_length_exceeded``
  wording) and within the KV pool;
- the sampling parameters' ranges (`SamplingParams.validate`, with the bounds of
  jobs/request_bounds.py).

Each mistake is a FieldError naming its field. What a door does not know is None in its
`ModelLimits`, and the next door that knows it checks it with the same function: the
tokenizer stage knows the context length (read from the model's files) but neither the
vocabulary the worker loaded nor its KV pool, so it checks the prompt and its fit, and the
worker checks it all again, sampling included (`check_request`, through
`Engine.build_request`). A prompt of token ids needs no tokenizer: the ingress checks it as
the tokenizer stage would (`tokenized_job`, with the context length where the model's files
are on its host) and sends it straight to the router. Tokenizing is passed in
(`PromptTokenizer`): the stages and the engine share one tokenizer (jobs/model_tokenizer.py:
tokenizers and jinja2), whose ids are transformers' (tests/test_stage_tokenizer.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jobs.field_error import FieldError
from jobs.protocol import ErrorReply, GenerateRequest, TokenizedRequest
from jobs.sampling_checks import SamplingParamError
from jobs.sampling_params import SamplingParams
from jobs.wire import MAX_TOKEN_ID


@dataclass(frozen=True)
class ModelLimits:
    """What a door knows of the model; None: not known there (a later door checks)."""

    vocab_size: int | None = None
    context_length: int | None = None
    kv_slots: int | None = None  # the KV pool: one request must fit it alone

    def room(self, prompt_tokens: int) -> int | None:
        """The most new tokens a prompt of this length can get; None if nothing bounds it."""
        bounds = [b for b in (self.context_length, self.kv_slots) if b is not None]
        return min(bounds) - prompt_tokens if bounds else None


class PromptTokenizer(Protocol):
    """Text and chats to token ids: what a door's tokenizer must offer."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]: ...


@dataclass
class Prompt:
    """One prompt as given: its field (``prompt``, ``messages``, ``input_ids``) and value."""

    field: str
    value: Any
    tools: Sequence[Mapping[str, Any]] | None = None


def split_prompts(
    prompt: Any = None,
    messages: Any = None,
    input_ids: Any = None,
    tools: Any = None,
    many: bool = False,
) -> tuple[list[Prompt], bool]:
    """The prompts a request gives, and whether it gave one (not a list of them).

    With `many`, a list of strings, of conversations or of token-id lists is several
    prompts (the engine's batches); a job is always one.
    """
    given = [n for n, v in (("prompt", prompt), ("messages", messages), ("input_ids", input_ids))
             if v is not None]  # fmt: skip
    if len(given) != 1:
        got = f" (got {', '.join(given)})" if given else ""
        raise ValueError(f"give exactly one of prompt, messages or input_ids{got}")
    if tools is not None and messages is None:
        raise FieldError("tools", "tools: they come with a chat (messages)")
    if prompt is not None:
        single = isinstance(prompt, str)
        texts = [prompt] if single else prompt
        listed = many and _is_list(texts) and all(isinstance(text, str) for text in texts)
        if not single and not listed:
            message = "prompt: must be a string" + (" or a list of strings" if many else "")
            raise FieldError("prompt", message)
        return _some([Prompt("prompt", text) for text in texts], "prompt"), single
    if messages is not None:
        single = not (many and _is_list(messages) and messages and _is_list(messages[0]))
        chats = [messages] if single else messages
        return _some([Prompt("messages", chat, tools) for chat in chats], "messages"), single
    if not _is_list(input_ids):
        message = "input_ids: must be a list of token ids" + (" or of such lists" if many else "")
        raise FieldError("input_ids", message)
    single = not (many and input_ids and _is_list(input_ids[0]))
    seqs = [input_ids] if single else input_ids
    if not all(_is_list(seq) for seq in seqs):
        raise FieldError("input_ids", "input_ids: a list of token-id lists holds only lists")
    return _some([Prompt("input_ids", list(seq)) for seq in seqs], "input_ids"), single


def encode_prompts(
    prompts: Sequence[Prompt], tokenizer: PromptTokenizer | None
) -> list[list[int] | ValueError]:
    """Each prompt's token ids, or the ValueError (a FieldError mostly) that prompt got, so
    a batch of jobs can answer each its own. Texts go to the tokenizer in one call; ids are
    as given, for `check_token_ids` to judge."""
    texts = [p.value for p in prompts if p.field == "prompt" and tokenizer is not None]
    encoded = iter(tokenizer.encode_batch(texts) if texts else [])
    out: list[list[int] | ValueError] = []
    for p in prompts:
        if p.field == "input_ids":
            out.append(p.value)
        elif tokenizer is None:
            message = f"{p.field}: this model has no tokenizer (a random: model); send input_ids"
            out.append(FieldError(p.field, message))
        elif p.field == "prompt":
            out.append(next(encoded))
        else:
            try:
                tools = [dict(tool) for tool in p.tools] if p.tools else None
                out.append(tokenizer.apply_chat_template(p.value, tools))
            except ValueError as exc:  # FieldError, or a template that does not parse
                out.append(exc)
    return out


def sampling_maps(sampling: Any, count: int) -> list[Mapping[str, Any] | None]:
    """One sampling map per prompt: one map (or None) for all, or a list of `count`."""
    if sampling is None or isinstance(sampling, Mapping):
        return [sampling] * count
    if not _is_list(sampling) or len(sampling) != count:
        raise SamplingParamError(
            "sampling_params",
            f"sampling_params must be one dict or a list of {count} dicts (one per prompt)",
        )
    return list(sampling)


def sampling_params(
    sampling: Mapping[str, Any] | None, prompt_tokens: int, field: str, limits: ModelLimits
) -> SamplingParams:
    """A prompt's parameters with the one default: a missing ``max_new_tokens`` is all that
    fit (a prompt that leaves no room is refused here, naming `field`). Types are checked;
    ranges are `check_request`'s."""
    if sampling is not None and not isinstance(sampling, Mapping):
        message = f"sampling_params must be a dict, got {type(sampling).__name__}"
        raise SamplingParamError("sampling_params", message)
    sampling = sampling or {}
    default = MAX_TOKEN_ID  # nothing known bounds it here: a later door does
    if "max_new_tokens" not in sampling:
        check_fits(prompt_tokens, None, field, limits)
        room = limits.room(prompt_tokens)
        default = default if room is None else room
    return SamplingParams.from_wire(sampling, default_max_new_tokens=default)


def check_request(
    ids: Sequence[int], params: SamplingParams, field: str, limits: ModelLimits
) -> None:
    """All a request's checks: its token ids, its parameters' ranges, and its fit."""
    check_token_ids(ids, field, limits.vocab_size)
    params.validate(MAX_TOKEN_ID + 1 if limits.vocab_size is None else limits.vocab_size)
    check_fits(len(ids), params.max_new_tokens, field, limits)


def check_prompt(
    ids: Sequence[int], field: str, limits: ModelLimits, max_new_tokens: Any = None
) -> None:
    """A prompt's checks before its parameters are (the tokenizer stage's): its token ids,
    and its fit with the ``max_new_tokens`` it asks for (an integer; anything else is left to
    `check_request`, and counts as missing here)."""
    check_token_ids(ids, field, limits.vocab_size)
    asked = max_new_tokens if type(max_new_tokens) is int else None
    check_fits(len(ids), None if asked is None else max(asked, 0), field, limits)


def tokenized_job(
    job: GenerateRequest, ids: list[int] | ValueError, field: str, limits: ModelLimits
) -> TokenizedRequest | ErrorReply:
    """The pipeline's job with its prompt as `ids` once they pass `check_prompt` (with the
    ``max_new_tokens`` the job asks for), else the 400 its requester gets; `ids` is the
    ValueError of a prompt that could not be tokenized. The tokenizer stage's answer to
    every job, and the ingress's to a prompt of token ids, which it sends the router
    directly: either door refuses the same prompt with the same ErrorReply."""
    try:
        if isinstance(ids, ValueError):
            raise ids
        asked = job.sampling.get("max_new_tokens") if isinstance(job.sampling, dict) else None
        check_prompt(ids, field, limits, asked)  # its type is the worker's to check
    except ValueError as exc:
        param, code = (exc.field, exc.code) if isinstance(exc, FieldError) else (None, None)
        return ErrorReply(job.rid, 400, str(exc), "invalid_request_error", param, code)
    return job.tokenized(ids)


def check_resumed_ids(ids: Sequence[int], params: SamplingParams, vocab_size: int | None) -> None:
    """The output ids a job resumes after (published by a worker that died): token ids, and
    no more than the job may generate (a job carrying more was not written by a worker)."""
    check_token_ids(ids, "output_ids", vocab_size)
    if params.max_new_tokens is not None and len(ids) > params.max_new_tokens:
        raise FieldError("output_ids", f"output_ids: {len(ids)} tokens resumed, more than "
                                       f"max_new_tokens ({params.max_new_tokens})")  # fmt: skip


def check_token_ids(ids: Sequence[int], field: str, vocab_size: int | None = None) -> None:
    """Token ids are integers in ``[0, vocab_size)`` (the wire's int32 where it is unknown)."""
    if len(ids) == 0:
        raise FieldError(field, f"{field}: the prompt is empty")
    if not set(map(type, ids)) <= {int}:  # bool, float or str are not ids (C speed)
        bad = next(token for token in ids if type(token) is not int)
        raise FieldError(field, f"{field}: token ids must be integers, got {bad!r}")
    if min(ids) < 0:
        raise FieldError(field, f"{field}: token ids must be >= 0")
    highest = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
    if max(ids) > highest:
        message = f"{field}: token id {max(ids)} is not in the vocabulary [0, {highest + 1})"
        raise FieldError(field, message)


def check_fits(prompt_tokens: int, max_new_tokens: int | None, field: str, limits: ModelLimits
               ) -> None:  # fmt: skip
    """The prompt and its new tokens (None: all that fit, so at least one) within the context
    and the KV pool. A prompt that leaves no room is the prompt's fault (`field`); one that
    would fit alone is ``max_new_tokens``'s."""
    new = 1 if max_new_tokens is None else max_new_tokens
    total = prompt_tokens + new
    context, slots = limits.context_length, limits.kv_slots
    if context is not None and total > context:
        # OpenAI: "This model's maximum context length is N tokens. However, you requested…"
        if max_new_tokens is None or prompt_tokens >= context:
            message = (
                f"This model's maximum context length is {context} tokens. However, your "
                f"{field} resulted in {prompt_tokens} tokens, which leaves no room for "
                f"output. Please reduce the length of the {field}."
            )
            raise FieldError(field, message, code="context_length_exceeded")
        message = (
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{total} tokens ({prompt_tokens} in the {field}, {new} in the completion). "
            f"Please reduce the length of the {field} or completion."
        )
        raise FieldError("max_new_tokens", message, code="context_length_exceeded")
    if slots is not None and total > slots:
        blamed = field if max_new_tokens is None or prompt_tokens >= slots else "max_new_tokens"
        message = (
            f"{blamed}: the {field} ({prompt_tokens} tokens) and {new} new tokens need "
            f"{total} KV slots; the KV pool has {slots}"
        )
        raise FieldError(blamed, message)


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, Mapping))


def _some(prompts: list[Prompt], field: str) -> list[Prompt]:
    if not prompts:
        raise FieldError(field, f"{field}: give at least one prompt")
    return prompts
