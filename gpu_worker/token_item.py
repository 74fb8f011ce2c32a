"""A request's TokenItem for one step: its new ids, the context to detokenize them, and the
logprobs and finish it asked for (bus/protocol.py's TokenItem; the worker publishes them)."""

from __future__ import annotations

from bus.protocol import Finish, TokenItem, token_context
from gpu_worker.scheduling.req import Req


def token_item(req: Req, reply_to: str, start: int, window: int) -> TokenItem:
    """The item of `req`'s output ids from index `start` on; `window`: output tokens of
    context the detokenizer needs (gpu_worker/worker.py)."""
    end = len(req.output_ids)
    context, prompt_context = token_context(req.origin_input_ids, req.output_ids, start, window)
    item = TokenItem(
        req.rid, reply_to, start, req.output_ids[start:end], context, prompt_context,
        req.params.stop, req.params.skip_special_tokens,
    )  # fmt: skip
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


def finish_of(req: Req, queue_seconds: float | None) -> Finish:
    """How a finished request ended, with its counts."""
    reason = req.finished_reason
    drafted = (req.draft.drafted, req.draft.accepted) if req.draft else (0, 0)
    return Finish(
        reason.kind, reason.matched, len(req.origin_input_ids), len(req.output_ids),
        req.prompt_cache_hit or 0, *drafted, queue_seconds,
    )  # fmt: skip


def _pairs(tops: list) -> list[list[list[float]]]:
    """Per token, its top alternatives as [id, logprob] lists (msgpack has no tuples)."""
    return [[[token, logprob] for token, logprob in top] for top in tops]
