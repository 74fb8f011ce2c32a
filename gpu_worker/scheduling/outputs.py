"""The request's side of sampling: what each logits row is sampled with (its request's
parameters, tokens so far, grammar and bias), and what the sampled token does to the
request — appended with its logprobs and text, then checked against every way a request
ends — and what finishing it flushes. The scheduler (scheduler.py) decides when."""

from __future__ import annotations

import logging

from gpu_worker.sampling.grammar import consume
from gpu_worker.sampling.penalties import SamplingRows
from gpu_worker.sampling.sampler import SamplingBatch
from gpu_worker.scheduling.req import FinishReason, Req
from jobs.grammar import grammar_field
from jobs.token_records import ENDED_SHORT

logger = logging.getLogger(__name__)


def sampling_batch(
    reqs: list[Req], outputs: list[list[int]], vocab_size: int, device
) -> SamplingBatch:
    """One row per request of `reqs`, whose output tokens so far are the same row of
    `outputs` (a verify row's include the drafts it follows)."""
    matchers = [req.matcher for req in reqs]
    drafts_before = []  # read only for grammar rows: a plain batch skips building it
    if any(matcher is not None for matcher in matchers):
        # A verify row's grammar state is the one after the drafts it follows.
        drafts_before = [out[len(r.output_ids) :] for r, out in zip(reqs, outputs, strict=True)]
    rows = SamplingRows(
        [req.params for req in reqs],
        [req.origin_input_ids for req in reqs],
        outputs,
        [req.blocked_until_min_tokens(len(out)) for req, out in zip(reqs, outputs, strict=True)],
        matchers,
        drafts_before,
        [req.logit_bias for req in reqs],
    )
    return SamplingBatch.build(rows, [req.generator for req in reqs], vocab_size, device)


def append_token(req: Req, token: int, logprob, top_logprobs, context_length: int) -> None:
    """`token` is the request's next: sets `req.finished_reason` where it ends the request."""
    req.output_ids.append(token)
    if req.params.logprobs:
        req.logprobs.append(logprob)
        if req.params.top_logprobs:
            req.top_logprobs.append(top_logprobs)
    stopped_by_string = False
    if req.text_stream is not None:
        text, stopped_by_string = req.text_stream.push([token])
        if text:
            req.pending_text.append(text)
    num_out = len(req.output_ids)
    grammar_error = None if req.matcher is None else consume(req.matcher, token)
    if grammar_error is not None:
        # The mask allows only tokens the grammar takes, so this is the grammar outgrowing
        # llguidance's limits mid-answer (a state past its lexer's budget), or a bug.
        logger.warning("request %s: grammar matcher failed: %s", req.rid, grammar_error)
        field = grammar_field(vars(req.params)) or "grammar"
        req.finished_reason = FinishReason(
            "error", f"{field} cannot be followed further: {grammar_error}", field
        )
    elif token in req.stop_ids and num_out >= req.params.min_new_tokens:
        req.finished_reason = FinishReason("stop", token)
    elif req.matcher is not None and req.matcher.is_stopped():
        req.finished_reason = FinishReason("stop")  # the grammar is complete
    elif stopped_by_string:
        req.finished_reason = FinishReason("stop", req.text_stream.matched_stop)
    elif num_out >= req.params.max_new_tokens or req.num_tokens >= context_length:
        req.finished_reason = FinishReason("length")


def finish_output(req: Req, reason: FinishReason) -> None:
    """The request ends with `reason`: its output is complete (its KV is the caller's)."""
    req.finished_reason = reason
    stopped_by_string = reason.kind == "stop" and isinstance(reason.matched, str)
    # Text held back as a possible stop-string start is real output unless the request
    # was aborted or that stop string did complete.
    if req.text_stream is not None and reason.kind not in ENDED_SHORT and not stopped_by_string:
        flushed = req.text_stream.flush()
        if flushed:
            req.pending_text.append(flushed)
