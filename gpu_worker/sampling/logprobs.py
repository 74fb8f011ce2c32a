"""Log-probabilities reported back to the client.

They are log_softmax of the RAW logits, before logit_bias, penalties, the min-tokens mask,
temperature and the top-k/top-p/min-p filters. That is what vLLM returns by default: the
model's own belief about each token, comparable across requests whatever their sampling
settings. (A token the filters excluded still has a finite logprob here.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpu_worker.scheduling.req import Req

TopLogprobs = list[tuple[int, float]]


def gather_logprobs(
    raw_logits: torch.Tensor,  # [bs, vocab] float32
    next_ids: torch.Tensor,  # [bs] int64, same device
    want: list[bool],
    top_n: list[int],
) -> tuple[list[float | None], list[TopLogprobs | None]]:
    """The chosen token's logprob per row (None where not wanted) and each row's `top_n` most
    likely (token id, logprob) pairs, most likely first (None where top_n is 0)."""
    bs = len(want)
    rows = [i for i in range(bs) if want[i]]
    chosen: list[float | None] = [None] * bs
    top: list[TopLogprobs | None] = [None] * bs
    if not rows:
        return chosen, top
    if len(rows) == bs:
        logits, ids = raw_logits, next_ids
    else:
        index = torch.tensor(rows, dtype=torch.int64, device=raw_logits.device)
        logits, ids = raw_logits[index], next_ids[index]
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen_values = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()  # host sync
    for i, row in enumerate(rows):
        chosen[row] = chosen_values[i]
    k = max(top_n[row] for row in rows)
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)  # sorted, most likely first
        values_list, indices_list = values.tolist(), indices.tolist()  # host sync
        for i, row in enumerate(rows):
            n = top_n[row]
            if n > 0:
                top[row] = list(zip(indices_list[i][:n], values_list[i][:n], strict=True))
    return chosen, top


def record_prompt_logprobs(
    reqs: list[Req],
    spans: list[tuple[int, int, int]],  # (request row, first position, end position)
    logits: torch.Tensor,  # [sum of the spans' lengths, vocab]: the prompt positions' logits
) -> None:
    """Append to each spanned request the logprobs of the prompt tokens its positions
    predict (the logits at position p score token p + 1), with its top_logprobs
    alternatives."""
    offset = 0
    for row, start, end in spans:
        req, count = reqs[row], end - start
        assert req.prompt_logprobs is not None and len(req.prompt_logprobs) == start
        targets = torch.tensor(req.origin_input_ids[start + 1 : end + 1], device=logits.device)
        top_n = req.params.top_logprobs
        chosen, top = gather_logprobs(
            logits[offset : offset + count].float(), targets, [True] * count, [top_n] * count
        )
        offset += count
        req.prompt_logprobs.extend(chosen)
        if top_n:
            req.prompt_top_logprobs.extend(top)
