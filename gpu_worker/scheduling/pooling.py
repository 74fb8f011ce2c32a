"""Embeddings: a request with a `pooling` (jobs/requests.py) pools its prompt's final hidden
states (after the model's final norm, before lm_head) instead of generating.

It rides the prefill (extend) path only, chunked and batched with other prefills like any
prompt; it never decodes, so CUDA graphs never see it. Each forward that computes some of its
positions sums the hidden rows it pools (`pool_spans`, summed by `ForwardBatch.pool_sums`):
every computed position for ``mean``, the prompt's last position for ``last``. The sums add
up on the request across chunks (`add_pooled`, in float32 whatever the model's dtype), and
once its prefill is done `embedding_of` divides (mean), L2-normalizes and packs the vector.

The prefix cache serves it nothing (request_kv.py's `_matchable_ids`): a cached position has
KV but no hidden state, so every position an embedding pools is computed in its own forward.
Its pages still go to the cache afterwards, for the requests that share its prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from jobs.token_records import pack_floats

if TYPE_CHECKING:
    from gpu_worker.scheduling.req import Req

MEAN, LAST = "mean", "last"


def pool_spans(
    reqs: list[Req], prefix_lens: list[int], extend_lens: list[int]
) -> list[tuple[int, int, int]]:
    """(request row, first position, end position) of the positions an extend must pool, for
    each embedding request it computes some of."""
    spans = []
    for i, (req, prefix, new) in enumerate(zip(reqs, prefix_lens, extend_lens, strict=True)):
        if req.pooling == MEAN:
            spans.append((i, prefix, prefix + new))
        elif req.pooling == LAST and prefix + new == len(req.origin_input_ids):
            spans.append((i, prefix + new - 1, prefix + new))
    return spans


def add_pooled(reqs: list[Req], spans: list[tuple[int, int, int]], sums: torch.Tensor) -> None:
    """Add each span's summed hidden rows (`sums`: [spans, hidden] float32) to its request's.
    A span from position 0 starts the sum afresh (a prefill computed again from the start)."""
    for (row, start, _), pooled in zip(spans, sums, strict=True):
        req = reqs[row]
        req.pooled = pooled if start == 0 or req.pooled is None else req.pooled + pooled


def embedding_of(req: Req) -> bytes:
    """The request's embedding, once its prefill is done: the pooled hidden state (divided by
    the prompt's length for mean pooling), L2-normalized, as packed little-endian float32."""
    assert req.pooled is not None, f"{req.rid}: no hidden state was pooled"
    vector = req.pooled
    if req.pooling == MEAN:
        vector = vector / len(req.origin_input_ids)
    vector = torch.nn.functional.normalize(vector, dim=0)
    req.pooled = None
    return pack_floats(vector.cpu().numpy())  # host sync: one vector per finished embedding
