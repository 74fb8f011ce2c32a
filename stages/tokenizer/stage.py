"""The tokenizer stage: text and chat jobs become token-id jobs.

Reads GenerateRequest from ``<p>:requests``, applies the chat template or encodes the
prompt (a batch of prompts in one call into the Rust tokenizer), and writes a
TokenizedRequest to ``<p>:tokenized``. A job this stage cannot tokenize gets an error reply
and is acknowledged: it is the client's mistake, not a reason to retry.

The prompt is read, tokenized and checked by jobs/request_normaliser.py, the functions
`Engine.generate` uses too, so both doors refuse the same prompts with the same errors.
This stage knows the model's context length (stages/tokenizer/context_length.py), not the
vocabulary the worker loaded: token ids are checked here to be ids (not negative), and
against the vocabulary by the worker, which also checks everything else again. A prompt
that leaves no room for a token, or that with the job's ``max_new_tokens`` exceeds the
context, gets a 400 ErrorReply (``context_length_exceeded``, OpenAI's wording) here, before
it reaches a worker stream, and never costs a worker anything.
"""

from __future__ import annotations

import logging
from typing import Any

from bus.actor import Inbound
from bus.effects import Outbound, Output, reply
from jobs.field_error import FieldError
from jobs.protocol import ErrorReply, GenerateRequest, TokenizedRequest
from jobs.request_normaliser import ModelLimits, check_prompt, encode_prompts, split_prompts
from runtime.config import BusConfig

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
        # The vocabulary and the KV pool are the worker's: it checks them (and all else again).
        self.limits = ModelLimits(context_length=context_length)

    def input_stream(self, config: BusConfig) -> str:
        return config.requests_stream()

    def handle(self, batch: list[Inbound]) -> list[Output]:
        jobs = [inbound.message for inbound in batch]
        # Each job is one prompt (a GenerateRequest holds exactly one, checked when it was
        # decoded, so splitting cannot fail); the batch's texts are tokenized in one call.
        prompts = [split_prompts(job.prompt, job.messages, job.input_ids, job.tools)[0][0]
                   for job in jobs]  # fmt: skip
        outputs: list[Output] = []
        for job, prompt, ids in zip(jobs, prompts, encode_prompts(prompts, self.tokenizer),
                                    strict=True):  # fmt: skip
            try:
                if isinstance(ids, ValueError):  # it could not be tokenized
                    raise ids
                check_prompt(ids, prompt.field, self.limits, _asked(job.sampling))
            except ValueError as exc:
                outputs.append(reply(self.config, job.reply_to, _bad_request(job, exc)))
                continue
            tokenized = TokenizedRequest(job.rid, job.reply_to, ids, job.sampling, job.created,
                                         job.tenant, job.weight, priority=job.priority,
                                         v=job.v, bundle_replies=job.bundle_replies,
                                         pooling=job.pooling, tag=job.tag)  # fmt: skip
            outputs.append(Outbound(self.config.tokenized_stream(), tokenized))
        return outputs


def _asked(sampling: Any) -> Any:
    """The job's ``max_new_tokens``, if it gave one (its type is the worker's to check)."""
    return sampling.get("max_new_tokens") if isinstance(sampling, dict) else None


def _bad_request(job: GenerateRequest, exc: ValueError) -> ErrorReply:
    param, code = (exc.field, exc.code) if isinstance(exc, FieldError) else (None, None)
    return ErrorReply(job.rid, 400, str(exc), "invalid_request_error", param, code)
