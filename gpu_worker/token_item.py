"""What the worker publishes of a running job: the job's record, and its TokenItem for one
publish (its new ids, the context to detokenize them, the logprobs and finish it asked for;
jobs/protocol.py's TokenItem)."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.scheduling.req import Req
from jobs.protocol import WIRE_VERSION, Finish, TokenItem, TokenizedRequest, token_context
from jobs.stop_strings import stop_window_tokens

# Output tokens of context per item beyond the longest stop string: covers a character
# split over up to 4 byte tokens, and a window start that decodes differently. Text needs
# 5; output of random byte tokens needs 8 (tests/test_detokenize.py), so 8, though each
# token less would save 2 bytes an item a publish (issue 27).
CONTEXT_TOKENS = 8


@dataclass
class RunningJob:
    req: Req
    reply_to: str
    entry_id: bytes  # acknowledged once every job of its entry ended, not before
    window: int  # output tokens of context the detokenizer needs
    reported: int = 0  # output tokens already published
    created: float | None = None  # unix time the job entered the system
    queue_seconds: float | None = None  # set at its first token here, unless it resumed
    reply_version: int = WIRE_VERSION  # its job's: the wire version its requester reads
    bundle: bool = False  # its job's bundle_replies
    tag: int | None = None  # its job's, if it is bundled: its items are named by it
    text_only: bool = False  # its job's: its bundled deltas count their ids


def stop_window(stop: list[str]) -> int:
    """Output tokens of context each of a job's items carries for the detokenizer."""
    return stop_window_tokens(stop, CONTEXT_TOKENS)


def token_item(
    req: Req, reply_to: str, start: int, window: int, reply_version: int = WIRE_VERSION,
    bundle: bool = False, tag: int | None = None, text_only: bool = False,
) -> TokenItem:  # fmt: skip
    """The item of `req`'s output ids from index `start` on; `window`: output tokens of
    context the detokenizer needs (gpu_worker/worker.py); `reply_version`: the wire version
    of its requester; `bundle`: whether it reads TextDeltas; `tag`: the job's, if bundled;
    `text_only`: whether its requester reads counts for ids (jobs/requests.py)."""
    end = len(req.output_ids)
    context, prompt_context = token_context(req.origin_input_ids, req.output_ids, start, window)
    item = TokenItem(
        req.rid, reply_to, start, req.output_ids[start:end], context, prompt_context,
        req.params.stop, req.params.skip_special_tokens, reply_version=reply_version,
        bundle=bundle, tag=tag if bundle else None, text_only=text_only,
    )  # fmt: skip
    item.embedding = req.embedding  # an embedding's vector, once its prefill is done
    if req.params.logprobs:
        item.logprobs = req.logprobs[start:end]
        if req.params.top_logprobs:
            item.top_logprobs = _pairs(req.top_logprobs[start:end])
    if start == 0 and req.prompt_logprobs is not None and req.prompt_logits_from == req.num_tokens:
        item.prompt_ids = req.origin_input_ids
        item.prompt_logprobs = [None, *req.prompt_logprobs]
        if req.params.top_logprobs:
            item.prompt_top_logprobs = [None, *_pairs(req.prompt_top_logprobs)]
    return item


def aborted_item(job: TokenizedRequest, generated: int) -> TokenItem:
    """The last item of a job aborted before it ran here, `generated` tokens in."""
    finish = Finish("abort", None, len(job.input_ids), generated)
    bundle = bool(job.bundle_replies)
    return TokenItem(job.rid, job.reply_to, generated, [], [], 0, finish=finish,
                     reply_version=job.v, bundle=bundle, tag=job.tag if bundle else None,
                     text_only=bool(job.text_only))  # fmt: skip


def finish_of(req: Req, queue_seconds: float | None) -> Finish:
    """How a finished request ended, with its counts."""
    reason = req.finished_reason
    drafted = (req.draft.drafted, req.draft.accepted) if req.draft else (0, 0)
    return Finish(
        reason.kind, reason.matched, len(req.origin_input_ids), len(req.output_ids),
        req.prompt_cache_hit or 0, *drafted, queue_seconds, param=reason.param,
    )  # fmt: skip


def _pairs(tops: list) -> list[list[list[float]]]:
    """Per token, its top alternatives as [id, logprob] lists (msgpack has no tuples)."""
    return [[[token, logprob] for token, logprob in top] for top in tops]
