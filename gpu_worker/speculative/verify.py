"""Which tokens a verify step emits for each request, given the target's logits.

A verify forward has one row of logits per request and position: row j follows the
request's last token and drafts 1..j. Both rules below emit the accepted drafts and then
one token of the target's own, so every step emits at least one token, and each emitted
token is distributed as the target would sample it given the tokens before it: greedy
output is that of plain decoding, and sampled output has its distribution.

- by_match, for drafts without a distribution (n-gram): sample every row as decoding
  would; accept drafts while the sample equals the draft. For a draft that is a single
  proposed token this is the rejection rule below with q one-hot.
- by_rejection, for drafts sampled from a draft model with distribution q: accept draft d
  with probability min(1, p(d) / q(d)); at the first rejection, emit a sample of the
  residual max(0, p - q), renormalised; after k acceptances, a sample of p at row k
  (Leviathan et al., 2023; Chen et al., 2023).
"""

from __future__ import annotations

import torch

from gpu_worker.sampling.logprobs import TopLogprobs, gather_logprobs
from gpu_worker.sampling.sampler import SampleOutput, SamplingBatch, draw, sampling_probs

# Per request: the tokens to emit in order, with their logprobs and top logprobs.
Emitted = list[tuple[int, float | None, TopLogprobs | None]]


def by_match(result: SampleOutput, drafts: list[list[int]]) -> list[Emitted]:
    emitted: list[Emitted] = []
    row = 0
    for request_drafts in drafts:
        tokens: Emitted = []
        for j in range(len(request_drafts) + 1):
            token = result.next_token_ids[row + j]
            tokens.append((token, result.logprobs[row + j], result.top_logprobs[row + j]))
            if j == len(request_drafts) or token != request_drafts[j]:
                break
        emitted.append(tokens)
        row += len(request_drafts) + 1
    return emitted


def by_rejection(
    logits: torch.Tensor,  # [rows, vocab] raw target logits
    sampling: SamplingBatch,  # of those rows
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],  # per request, [len(drafts), vocab]
    generators: list[torch.Generator | None],  # per request; None: `default`
    default: torch.Generator,
) -> list[Emitted]:
    p = sampling_probs(logits, sampling)
    chosen = p.argmax(dim=-1)  # rows past a request's last emitted token keep this
    row = 0
    tokens_per_request: list[list[int]] = []
    for i, request_drafts in enumerate(drafts):
        tokens: list[int] = []
        q = draft_probs[i]
        generator = generators[i] or default
        for j, token in enumerate(request_drafts):
            assert q is not None
            target, proposal = float(p[row + j, token]), float(q[j, token])
            if proposal > 0 and float(torch.rand(1, generator=generator)) < target / proposal:
                tokens.append(token)
                continue
            residual = (p[row + j] - q[j]).clamp_(min=0)
            tokens.append(draw(residual if residual.sum() > 0 else p[row + j], generator))
            break
        else:
            tokens.append(draw(p[row + len(request_drafts)], generator))
        for j, token in enumerate(tokens):
            chosen[row + j] = token
        tokens_per_request.append(tokens)
        row += len(request_drafts) + 1
    logprobs, top = gather_logprobs(
        logits.float(), chosen, sampling.want_logprobs, sampling.top_logprobs
    )
    emitted: list[Emitted] = []
    row = 0
    for request_drafts, tokens in zip(drafts, tokens_per_request, strict=True):
        emitted.append([(t, logprobs[row + j], top[row + j]) for j, t in enumerate(tokens)])
        row += len(request_drafts) + 1
    return emitted
