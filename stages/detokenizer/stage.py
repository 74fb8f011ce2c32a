"""The detokenizer stage: each engine step's tokens become text deltas on reply streams.

Reads TokenBatch from ``<p>:tokens`` and writes one TextDelta per request to the stream
its ``reply_to`` names. Stateless (stages/detokenizer/incremental.py), so any replica handles
any batch; readers order a request's deltas by ``seq``.
"""

from __future__ import annotations

from typing import Any

from bus.actor import Inbound
from bus.config import BusConfig
from bus.effects import Outbound, Output
from bus.protocol import TextDelta, TokenBatch, TokenItem
from stages.detokenizer.incremental import text_deltas


class DetokenizerStage:
    group = "detokenizer"
    accepts = (TokenBatch,)

    def __init__(self, config: BusConfig, tokenizer: Any | None) -> None:
        self.config = config
        self.tokenizer = tokenizer  # None: a random: model; deltas carry ids only

    def input_stream(self, config: BusConfig) -> str:
        return config.tokens_stream()

    def handle(self, batch: list[Inbound]) -> list[Output]:
        items = [item for inbound in batch for item in inbound.message.items]
        texts = text_deltas(self.tokenizer, items) if self.tokenizer else [None] * len(items)
        return [
            Outbound(item.reply_to, self._delta(item, text), expire_s=self.config.reply_ttl_s)
            for item, text in zip(items, texts, strict=True)
        ]

    def _delta(self, item: TokenItem, text: str | None) -> TextDelta:
        delta = TextDelta(item.rid, item.start, item.ids, text)
        if item.finish is not None:
            delta.finish = item.finish.to_wire()
        if item.logprobs is not None:
            delta.logprobs = item.logprobs
            delta.top_logprobs = item.top_logprobs
            if self.tokenizer is not None:
                delta.token_texts = self.tokenizer.token_texts(item.ids)
                if item.top_logprobs:
                    delta.top_token_texts = [
                        self.tokenizer.token_texts([int(token) for token, _ in top])
                        for top in item.top_logprobs
                    ]
        return delta
