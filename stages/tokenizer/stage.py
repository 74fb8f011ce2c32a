"""The tokenizer stage: text and chat jobs become token-id jobs.

Reads GenerateRequest from ``<p>:requests``, applies the chat template or encodes the
prompt (a batch of prompts in one call into the Rust tokenizer), and writes a
TokenizedRequest to ``<p>:tokenized``. Token-id jobs pass through; their ids are checked
against the model's vocabulary by the worker, which knows it. A job this stage cannot
tokenize gets an error reply and is acknowledged: it is the client's mistake, not a reason
to retry.

Every prompt, token-id jobs' too, is checked against the model's context length
(stages/tokenizer/context_length.py) here, before it reaches a worker stream: a prompt that
leaves no room for a token, or that with the job's ``max_new_tokens`` exceeds the context,
gets a 400 ErrorReply (``context_length_exceeded``, OpenAI's wording) and never costs a
worker anything.
"""

from __future__ import annotations

import logging
from typing import Any

from bus.actor import Inbound
from bus.config import BusConfig
from bus.effects import Outbound, Output, reply
from jobs.field_error import FieldError
from jobs.protocol import ErrorReply, GenerateRequest, TokenizedRequest

logger = logging.getLogger(__name__)


class TokenizerStage:
    group = "tokenizer"
    accepts = (GenerateRequest,)

    def __init__(
        self, config: BusConfig, tokenizer: Any | None, context_length: int | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer  # None: a random: model, which takes token ids only
        self.context_length = context_length  # None: unknown here, the worker checks

    def input_stream(self, config: BusConfig) -> str:
        return config.requests_stream()

    def handle(self, batch: list[Inbound]) -> list[Output]:
        jobs = [inbound.message for inbound in batch]
        texts = [job.prompt for job in jobs if job.prompt is not None and self.tokenizer]
        encoded = iter(self.tokenizer.encode_batch(texts) if texts else [])
        outputs: list[Output] = []
        for job in jobs:
            try:
                ids = self._token_ids(job, encoded)
            except ValueError as exc:
                outputs.append(reply(self.config, job.reply_to, _bad_request(job, exc)))
                continue
            tokenized = TokenizedRequest(job.rid, job.reply_to, ids, job.sampling, job.created,
                                         job.tenant, job.weight, priority=job.priority,
                                         v=job.v)  # fmt: skip
            outputs.append(Outbound(self.config.tokenized_stream(), tokenized))
        return outputs

    def _token_ids(self, job: GenerateRequest, encoded) -> list[int]:
        if job.input_ids is not None:
            ids = job.input_ids
            field = "input_ids"
        elif self.tokenizer is None:
            field = "prompt" if job.prompt is not None else "messages"
            raise FieldError(field, f"{field}: this model has no tokenizer (a random model); "
                             "send input_ids")  # fmt: skip
        elif job.prompt is not None:
            ids = next(encoded)
            field = "prompt"
        else:
            ids = self.tokenizer.apply_chat_template(job.messages, job.tools)
            field = "messages"
        if not ids:
            raise FieldError(field, f"{field}: the prompt is empty")
        if min(ids) < 0:
            raise FieldError(field, f"{field}: token ids must be >= 0")
        self._check_fits(job, len(ids), field)
        return ids

    def _check_fits(self, job: GenerateRequest, prompt_tokens: int, field: str) -> None:
        """The prompt, and the tokens the job asks for, within the model's context."""
        limit = self.context_length
        if limit is None:
            return
        asked = job.sampling.get("max_new_tokens") if isinstance(job.sampling, dict) else None
        new = asked if isinstance(asked, int) and not isinstance(asked, bool) else None
        if prompt_tokens + (1 if new is None else max(new, 0)) <= limit:
            return
        # OpenAI: "This model's maximum context length is N tokens. However, you requested…"
        if new is None or prompt_tokens >= limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{field} resulted in {prompt_tokens} tokens, which leaves no room for "
                f"output. Please reduce the length of the {field}."
            )
            raise FieldError(field, message, code="context_length_exceeded")
        message = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + new} tokens ({prompt_tokens} in the {field}, {new} in the "
            f"completion). Please reduce the length of the {field} or completion."
        )
        raise FieldError("max_new_tokens", message, code="context_length_exceeded")


def _bad_request(job: GenerateRequest, exc: ValueError) -> ErrorReply:
    param, code = (exc.field, exc.code) if isinstance(exc, FieldError) else (None, None)
    return ErrorReply(job.rid, 400, str(exc), "invalid_request_error", param, code)
