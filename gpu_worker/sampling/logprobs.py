"""Log-probabilities reported back to the client.

They are log_softmax of the RAW logits, before logit_bias, penalties, the min-tokens mask,
temperature and the top-k/top-p/min-p filters. That is what vLLM returns by default: the
model's own belief about each token, comparable across requests whatever their sampling
settings. (A token the filters excluded still has a finite logprob here.)
"""

from __future__ import annotations

import torch

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
