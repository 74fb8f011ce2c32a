"""The native /generate endpoint's answer shapes: ``meta_info`` and its logprobs, in SGLang's
names (``output_token_logprobs``: ``[logprob, id, text]`` per token; ``input_token_logprobs``
for the prompt, its first entry's logprob null)."""

from __future__ import annotations

from typing import Any

from jobs.protocol import TextDelta


def meta_info(delta: TextDelta | None, rid: str) -> dict[str, Any]:
    finish = None if delta is None else delta.finish_info()
    meta: dict[str, Any] = {"id": rid, "finish_reason": None if finish is None else finish.reason}
    if finish is not None:
        meta.update(
            matched_stop=finish.matched,
            prompt_tokens=finish.prompt_tokens,
            completion_tokens=finish.completion_tokens,
            cached_tokens=finish.cached_tokens,
        )
        if finish.draft_tokens:
            meta.update(draft_tokens=finish.draft_tokens,
                        accepted_draft_tokens=finish.accepted_draft_tokens)  # fmt: skip
        if finish.weights_version:  # the weights that computed it (docs/WEIGHT_UPDATES.md)
            meta["weights_version"] = finish.weights_version
    return meta


def native_logprobs(delta: TextDelta) -> dict[str, list]:
    texts = delta.token_texts or [None] * len(delta.ids)
    return {
        "output_token_logprobs": [
            [lp, token, text]
            for lp, token, text in zip(delta.logprobs or [], delta.ids, texts, strict=False)
        ],
        "output_top_logprobs": [
            [[lp, int(token), None] for token, lp in row] for row in delta.top_logprobs or []
        ],
    }


def native_prompt_logprobs(delta: TextDelta) -> dict[str, list]:
    """The prompt's logprobs in SGLang's names, on the delta that carries them."""
    if delta.prompt_ids is None or delta.prompt_logprobs is None:
        return {}
    texts = delta.prompt_token_texts or [None] * len(delta.prompt_ids)
    meta = {
        "input_token_logprobs": [
            [lp, token, text]
            for lp, token, text in zip(delta.prompt_logprobs, delta.prompt_ids, texts, strict=False)
        ]
    }
    if delta.prompt_top_logprobs is not None:
        meta["input_top_logprobs"] = [
            None if row is None else [[lp, int(token), None] for token, lp in row]
            for row in delta.prompt_top_logprobs
        ]
    return meta
