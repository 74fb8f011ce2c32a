"""The detokenizer stage: each engine step's tokens become text deltas on reply streams.

Reads the TokenBatch in every worker's progress log (``<p>:progress:<worker>``, field ``t``:
a worker publishes its tokens and logs its progress in one entry, bus/fenced_stream.py) and
in ``<p>:tokens`` (where older workers publish, and where a worker says it opened its log,
so the stage reads that log at once: bus/extra_inputs.py). It writes each item's TextDelta
to the stream its ``reply_to`` names: the deltas of the jobs that asked for bundles
(``bundle_replies``: the ingress's and `Client`'s) bound to one stream go in one TextDeltas
entry per batch read, so a reply stream costs one XADD per batch, whatever the requests and
tokens in it; the others get an entry each. A stream's expiry is renewed in the same
pipeline: a bundled stream's once a quarter TTL per replica
(stages/detokenizer/stream_expiries.py), the others' with every batch (a stream its reader
deleted, written again by a late delta, still goes). Stateless as to requests
(stages/detokenizer/incremental.py), so any replica handles any batch; readers order a
request's deltas by ``seq`` and drop one they already have, so the stage is
``replayable``: its writes need no MULTI, and its inputs are acknowledged with its next
read (bus/actor.py).

A batch holds many requests' tokens, so one item the stage cannot wholly handle (ids no
tokenizer decodes, such as a negative one; logprobs of another shape: a worker's bug, or
anyone writing to Redis) goes without what failed, its text or its logprobs, with a
warning: its stream goes on, and its batch-mates' are untouched. Raised from `handle`, it
would have dead-lettered the whole entry, every request in it left waiting for tokens that
never come. An item that does not even read (`TokenBatch.refused`) ends its request with an
error reply, where it names the request.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from bus.actor import Inbound
from bus.effects import ExpireKey, Outbound, Output
from bus.fenced_stream import LOG_READERS_GROUP
from bus.liveness import registered_workers
from jobs.legacy_records import finish_as_list
from jobs.protocol import (
    TOKENS_FIELD,
    ErrorReply,
    Message,
    TextDelta,
    TextDeltas,
    TokenBatch,
    TokenItem,
)
from runtime.config import BusConfig
from stages.detokenizer.incremental import text_deltas
from stages.detokenizer.stream_expiries import StreamExpiries

logger = logging.getLogger(__name__)

# How long a worker's word that it opened its log keeps that log read before the worker is
# registered (its first heartbeat follows at once), and how many such words are kept.
ANNOUNCED_S = 60.0
MAX_ANNOUNCED = 1024


class DetokenizerStage:
    group = LOG_READERS_GROUP  # "detokenizer", on the tokens stream and every worker's log
    accepts = (TokenBatch,)
    replayable = True  # a batch handled twice writes deltas its readers drop as copies
    extra_field = TOKENS_FIELD  # a log entry's token batch (bus/actor.py: extra inputs)

    def __init__(self, config: BusConfig, tokenizer: Any | None) -> None:
        self.config = config
        self.tokenizer = tokenizer  # None: a random: model; deltas carry ids only
        # The default TTL where the stage is made for its pure parts (`_delta`), with no config.
        ttl_s = (config or BusConfig()).reply_ttl_s
        self.expiries = StreamExpiries(ttl_s)
        # Workers that said they opened their log, not yet registered: id -> when.
        self._announced: dict[str, float] = {}

    def input_stream(self, config: BusConfig) -> str:
        return config.tokens_stream()

    def extra_inputs(self, client: redis.Redis) -> list[str]:
        """The progress log of every worker registered (alive, or dead and not yet reaped:
        the reaper moves what this group has not read off a log before it deletes it), and
        of those that said on the tokens stream that they opened one (a worker opens its log
        before its first heartbeat registers it)."""
        ids = set(registered_workers(client, self.config))
        now = time.monotonic()
        self._announced = {worker_id: since for worker_id, since in self._announced.items()
                           if worker_id not in ids and now - since < ANNOUNCED_S}  # fmt: skip
        logs = []
        for worker_id in sorted(ids | set(self._announced)):
            try:
                logs.append(self.config.progress_stream(worker_id))
            except ValueError:  # a member or word that names no worker: not a log of ours
                continue
        return logs

    def handle(self, batch: list[Inbound]) -> list[Output]:
        for inbound in batch:
            if not inbound.message.items and len(self._announced) < MAX_ANNOUNCED:
                # A worker that opened its log says so with an empty batch: read that log.
                self._announced[inbound.message.worker_id] = time.monotonic()
        items = [item for inbound in batch for item in inbound.message.items]
        sources = [inbound.message for inbound in batch for _ in inbound.message.items]
        texts = self._item_texts(items)
        bundles: dict[str, list[TextDelta]] = {}
        entries: list[tuple[str, Message]] = [  # an item that did not read: its error
            answer for inbound in batch if inbound.message.refused
            for answer in _unread_items(inbound.message)
        ]  # fmt: skip
        for item, text, source in zip(items, texts, sources, strict=True):
            try:
                delta = self._delta(item, text)
            except Exception as exc:  # its logprobs: the tokens still go (module doc)
                _degraded(item, "its logprobs", exc)
                delta = self._plain_delta(item, text)
            if item.start == 0:  # a request's first delta names the weights computing it
                delta.weights_version = source.weights
                if item.bundle:  # and to an ingress, the worker (to abort it there at once)
                    delta.worker = source.worker_id
            if item.bundle:
                bundle = bundles.get(item.reply_to)
                if bundle is None:
                    bundle = bundles[item.reply_to] = []
                    entries.append((item.reply_to, TextDeltas(bundle)))
                bundle.append(delta)
            else:
                entries.append((item.reply_to, delta))
        now = time.monotonic()
        self.expiries.begin()
        renew = dict.fromkeys(  # each once, in order
            stream for stream, message in entries
            if not isinstance(message, TextDeltas) or self.expiries.due(stream, now)
        )  # fmt: skip
        for stream in renew:
            self.expiries.renewing(stream, now)
        outputs: list[Output] = [Outbound(stream, message, create=stream in renew)
                                 for stream, message in entries]  # fmt: skip
        return outputs + [ExpireKey(stream, self.config.reply_ttl_s) for stream in renew]

    def committed(self) -> None:
        """The Actor committed the last batch: its renewals happened."""
        self.expiries.committed(time.monotonic())

    def reconnected(self) -> None:
        """Redis may be back empty: every stream is written as if new (made, and expiring)."""
        self.expiries.forget()

    def _item_texts(self, items: list[TokenItem]) -> list[str | None]:
        """The text each item adds (None for all without a tokenizer). Decoded together;
        where that fails, one by one, and an item whose ids no tokenizer decodes (a negative
        id) adds no text (module doc)."""
        if self.tokenizer is None:
            return [None] * len(items)
        try:
            return text_deltas(self.tokenizer, items)  # type: ignore[return-value]
        except Exception:
            pass
        texts: list[str | None] = []
        for item in items:
            try:
                texts.extend(text_deltas(self.tokenizer, [item]))
            except Exception as exc:
                _degraded(item, "its text", exc)
                texts.append("")
        return texts

    def _plain_delta(self, item: TokenItem, text: str | None) -> TextDelta:
        """An item's delta without its logprobs: its tokens, their text, its finish."""
        delta = TextDelta(item.rid, item.start, item.ids, text, embedding=item.embedding,
                          tag=item.tag)  # fmt: skip
        if item.text_only and item.bundle:  # its reader counts tokens (jobs/requests.py)
            delta.ids, delta.n = [], len(item.ids)
        if item.finish is not None:
            # In the version its requester reads: a job written without one gets the list.
            delta.finish = (
                item.finish.to_wire() if item.reply_version >= 2 else finish_as_list(item.finish)
            )
        return delta

    def _delta(self, item: TokenItem, text: str | None) -> TextDelta:
        delta = self._plain_delta(item, text)
        if item.logprobs is not None:
            delta.logprobs = item.logprobs
            delta.top_logprobs = item.top_logprobs
            if self.tokenizer is not None:
                delta.token_texts, delta.top_token_texts = self._texts(item.ids, item.top_logprobs)
        if item.prompt_ids is not None:
            delta.prompt_ids = item.prompt_ids
            delta.prompt_logprobs = item.prompt_logprobs
            delta.prompt_top_logprobs = item.prompt_top_logprobs
            if self.tokenizer is not None:
                delta.prompt_text = self.tokenizer.decode(
                    item.prompt_ids, skip_special_tokens=item.skip_special_tokens
                )
                delta.prompt_token_texts, delta.prompt_top_token_texts = self._texts(
                    item.prompt_ids, item.prompt_top_logprobs
                )
        return delta

    def _texts(self, ids: list[int], tops: list | None) -> tuple[list[str], list | None]:
        """Each token's own text, and those of its top alternatives (None where it has none:
        a prompt's first token)."""
        top_texts = None
        if tops:
            top_texts = [
                None if top is None else self.tokenizer.token_texts([int(t) for t, _ in top])
                for top in tops
            ]
        return self.tokenizer.token_texts(ids), top_texts


def _degraded(item: TokenItem, what: str, exc: Exception) -> None:
    logger.warning("request %.80s (tag %s), tokens from %d: %s failed (%s: %s); sent without it",
                   item.rid, item.tag, item.start, what, type(exc).__name__, exc)  # fmt: skip


def _unread_items(batch: TokenBatch) -> list[tuple[str, ErrorReply]]:
    """An error for each item of `batch` that did not read (`TokenBatch.refused`) and names
    its request and reply stream: its request ends, told why, rather than waiting for these
    tokens until its reply timeout. One that names neither can only be logged."""
    answers = []
    for rid, reply_to, why in batch.refused:
        logger.warning("worker %s, step %s: a token item of request %.80s does not read: %s",
                       batch.worker_id, batch.step, rid, why)  # fmt: skip
        if rid is not None and reply_to is not None:
            message = f"the worker's tokens for this request could not be read: {why}"[:500]
            answers.append((reply_to, ErrorReply(rid, 500, message, "internal_error", None,
                                                 "unreadable_tokens")))  # fmt: skip
    return answers
