"""The tokenizer stage: text and chat jobs become token-id jobs.

Reads GenerateRequest from ``<p>:requests``, applies the chat template or encodes the
prompt (a batch of prompts in one call into the Rust tokenizer), and writes a
TokenizedRequest to ``<p>:tokenized``. A job this stage cannot tokenize gets an error reply
and is acknowledged: it is the client's mistake, not a reason to retry. The ingress writes
a prompt of token ids to ``<p>:tokenized`` itself, after this stage's checks
(`tokenized_job`): such a prompt reaches this stage only from a direct client
(bus/client.py), so the hop (and the prompt's bytes on it) is spent on text and chats.

The prompt is read, tokenized and checked by jobs/request_normaliser.py, the functions
`Engine.generate` uses too, so both doors refuse the same prompts with the same errors.
This stage knows the model's context length (runtime/context_length.py), not the
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
from jobs.protocol import ErrorReply, GenerateRequest
from jobs.request_normaliser import ModelLimits, encode_prompts, split_prompts, tokenized_job
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
            tokenized = tokenized_job(job, ids, prompt.field, self.limits)
            if isinstance(tokenized, ErrorReply):
                outputs.append(reply(self.config, job.reply_to, tokenized))
            else:
                outputs.append(Outbound(self.config.tokenized_stream(), tokenized))
        return outputs
