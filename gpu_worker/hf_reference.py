"""transformers as the reference: its greedy tokens (the correctness anchor) and the time of
its padded-batch generate (the throughput baseline), on whatever device the model is on.
The tests, benchmarks/bench_engine.py and `streamserve gpu-check` use these two."""

from __future__ import annotations

import time

import torch


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = True):
    """transformers' greedy generate, one prompt at a time (no padding to perturb it)."""
    device = next(model.parameters()).device
    options = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": 0}
    if not stop_at_eos:
        # As a keyword, None turns stopping off; set on a GenerationConfig, transformers 5
        # merges the model's eos back in.
        options["eos_token_id"] = None
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                **options,
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


def hf_generate_seconds(model, prompts: list[list[int]], max_new: int) -> float:
    """Seconds for one left-padded batch generating exactly `max_new` tokens per prompt."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as transformers generates
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert out.shape[1] == width + max_new
    return time.perf_counter() - start


def is_near_tie(model, model_float32, ids: list[int], one: int, other: int) -> bool:
    """Whether greedy may pick either `one` or `other` after `ids` in `model`'s precision:
    their float32 logits are closer than twice the largest rounding difference between
    `model` and its float32 copy there (as with any two summation orders)."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        batch = torch.tensor([ids], device=device)
        low = model(batch).logits[0, -1].float()
        exact = model_float32(batch).logits[0, -1].float()
    rounding = (low - exact).abs().max()
    return bool((exact[one] - exact[other]).abs() <= 2 * rounding)
