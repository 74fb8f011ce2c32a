"""`TokenBatch`: what a worker publishes at once, one `TokenItem` per request that gained
tokens in its step (jobs/token_records.py), on its progress log (field ``t``) or the tokens
stream; the detokenizers read it (stages/detokenizer/stage.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from jobs.token_records import TokenItem
from jobs.wire import (
    BOOL,
    INT,
    LIST,
    STR,
    WIRE_VERSION,
    Message,
    ProtocolError,
    check_field,
    check_version,
)


@dataclass
class TokenBatch(Message):
    """What a worker publishes at once: one item per request that gained tokens.

    The reply stream (and ``bundle`` and ``text_only`` flags) most of its items share is
    written once, as the batch's ``reply_to``, ``bundle`` and ``text_only``, and left off
    those items: with one ingress a whole batch shares it, and it was a fifth of an item's
    bytes. An item with its own keeps it.
    ``weights`` is the version of the weights that computed every item (a worker swaps them
    only with nothing running: gpu_worker/weights_update.py); None from a worker that names
    none.
    An item that does not read is left out of ``items`` and named in ``refused`` (its rid
    and reply stream where it says them, and why), not a failure of the whole batch: its
    batch-mates are other requests' tokens. A batch of which no item reads is malformed.
    """

    KIND = "tokens"
    COMPRESSIBLE = True
    FIELDS = {"worker_id": STR, "step": INT, "items": LIST, "v": INT, "weights": STR}
    OPTIONAL = frozenset({"v", "weights"})

    worker_id: str
    step: int
    items: list[TokenItem]
    # Its items' wire version: maps by name (2); absent, the lists of older workers (1).
    v: int = WIRE_VERSION
    weights: str | None = None
    # Read, never written: (rid, reply_to, why) of each item that did not read.
    refused: list[tuple[str | None, str | None, str]] = field(
        default_factory=list, compare=False, repr=False
    )

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TokenBatch:
        version = check_version("tokens batch", data.get("v"))
        batch = super().from_wire(data)
        batch.v = version
        shared = None
        if data.get("reply_to") is not None:
            shared = {
                "reply_to": check_field(STR, "reply_to", data["reply_to"], False),
                "bundle": check_field(BOOL, "bundle", data.get("bundle", False), False),
                "text_only": check_field(BOOL, "text_only", data.get("text_only", False), False),
            }
        items = []
        for raw in batch.items:
            try:
                items.append(TokenItem.from_wire(raw, shared))
            except ProtocolError as exc:
                batch.refused.append((*_item_address(raw, shared), str(exc)))
        if batch.refused and not items:
            raise ProtocolError(batch.refused[0][2])
        batch.items = items
        return batch

    def to_wire(self) -> dict[str, Any]:
        shared = _shared_reply(self.items)
        wire = {"kind": self.KIND, "worker_id": self.worker_id, "step": self.step,
                "items": [item.to_wire(shared) for item in self.items], "v": self.v}  # fmt: skip
        if shared is not None:
            wire["reply_to"], wire["bundle"] = shared[:2]
            if shared[2]:
                wire["text_only"] = True
        if self.weights is not None:
            wire["weights"] = self.weights
        return wire


def _item_address(raw: Any, shared: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """The rid and reply stream an item that did not read names, where it names them."""
    if not isinstance(raw, dict):
        return None, None
    rid, reply_to = raw.get("rid"), raw.get("reply_to", (shared or {}).get("reply_to"))
    return (rid if isinstance(rid, str) and rid else None,
            reply_to if isinstance(reply_to, str) and reply_to else None)  # fmt: skip


def _shared_reply(items: list[TokenItem]) -> tuple[str, bool, bool] | None:
    """The (reply_to, bundle, text_only) of most items, when more than one item has it."""
    counts = Counter((item.reply_to, item.bundle, item.text_only) for item in items)
    if not counts:
        return None
    shared, count = counts.most_common(1)[0]
    return shared if count > 1 else None
