"""Which requests draft how many tokens this step, and backing off where drafts miss.

A verify step costs more than a decode step: every drafted token is computed, and the
batch takes the extend attention path. Drafting pays only while drafts are accepted, so
each request adapts its draft length to what it has been getting accepted, and a request
whose drafts keep missing stops drafting for a while, longer each time.

The step as a whole verifies only when that should emit tokens faster than decoding:
(requests + expected accepted drafts) / (verify time) > requests / (decode time). Both
times are measured as the engine runs (StepCosts), per batch-size bucket and, for verify
steps, per tokens computed per request, as what a draft costs depends on both: little at
batch 1 on a GPU, where a forward reads the weights whatever the token count; on a CPU a
few-row matmul already costs twice a one-row one; in a large batch, a token's compute.
"""

from __future__ import annotations

from gpu_worker.scheduling.req import Req
from gpu_worker.speculative.draft_state import PRIOR_ACCEPTANCE, DraftState

MAX_BACKOFF_STEPS = 64
# How fast a request's acceptance rate follows what its verify steps accept.
ACCEPTANCE_DECAY = 0.7
# A draft the cost model turned down is not verified, so nothing would ever raise its
# request's estimate again: each turned-down step moves it back toward the prior.
ACCEPTANCE_RECOVERY = 0.05
COST_DECAY = 0.8


class StepCosts:
    """Moving averages of a step's seconds per request: decode steps by batch-size bucket,
    verify steps by that bucket and the tokens computed per request."""

    def __init__(self) -> None:
        self.decode: dict[int, float] = {}
        self.verify: dict[tuple[int, int], float] = {}

    @staticmethod
    def key(batch_size: int, tokens: int) -> tuple[int, int]:
        return batch_size.bit_length(), round(tokens / batch_size)

    def record(self, verify: bool, batch_size: int, tokens: int, seconds: float) -> None:
        per_request = seconds / batch_size
        if verify:
            _average(self.verify, self.key(batch_size, tokens), per_request)
        else:
            _average(self.decode, batch_size.bit_length(), per_request)

    def verify_pays(self, batch_size: int, drafted: int, expected_accepted: float) -> bool:
        decode = self.decode.get(batch_size.bit_length())
        verify = self.verify.get(self.key(batch_size, batch_size + drafted))
        if decode is None or verify is None:
            return True  # try it, and measure
        # Tokens per second of each kind of step: (bs + accepted) / (bs * v) vs bs / (bs * d).
        return (batch_size + expected_accepted) / verify > batch_size / decode


def _average(table: dict, key, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else COST_DECAY * old + (1 - COST_DECAY) * value


class Drafter:
    """What every proposer shares: draft lengths, backoff, step costs and figures."""

    # Per request id, the distribution each draft was sampled from ([k, vocab]), for
    # proposers that have one; None: drafts are verified by matching the target's samples.
    draft_probs: dict | None = None
    # Whether a grammar request drafts: a proposer that does makes every draft one the
    # grammar takes (n-gram: cut at the first it refuses; draft model: sampled under the
    # mask), and verify masks each row in the grammar's state after the drafts before it.
    drafts_under_grammar = False

    def __init__(self, num_draft_tokens: int, verify: str = "when_it_pays") -> None:
        self.num_draft_tokens = num_draft_tokens
        self.verify_always = verify == "always"  # EngineConfig.speculative_verify
        self.costs = StepCosts()
        self.verify_steps = 0
        self.drafted = 0
        self.accepted = 0

    def propose(self, reqs: list[Req], context_length: int) -> list[list[int]] | None:
        """Drafts per request for a verify step, or None when this step should decode."""
        raise NotImplementedError

    def rewind(self, req: Req, accepted: int) -> None:
        """After verification: forget the drafts past the `accepted` first ones."""

    def draft_length(self, req: Req, context_length: int) -> int:
        """How many tokens `req` drafts this step: 0 while it backs off."""
        state = req.draft
        if state is None:
            state = req.draft = DraftState(length=self.num_draft_tokens)
        if req.matcher is not None and not self.drafts_under_grammar:
            return 0  # it decodes plainly, with a 0-draft row in verify steps
        if state.pause:
            state.pause -= 1
            return 0
        # Drafts past the last token the request may emit would only be thrown away.
        room = min(
            req.params.max_new_tokens - len(req.output_ids) - 1,
            context_length - req.num_tokens - 1,
        )
        return max(0, min(state.length, room))

    def worth_verifying(self, reqs: list[Req], drafts: list[list[int]]) -> bool:
        drafted = sum(len(d) for d in drafts)
        if not drafted:
            return False
        if self.verify_always:
            return True
        expected = sum(req.draft.acceptance * len(d) for req, d in zip(reqs, drafts, strict=True))
        if self.costs.verify_pays(len(reqs), drafted, expected):
            return True
        for req, d in zip(reqs, drafts, strict=True):
            if d and req.draft.acceptance < PRIOR_ACCEPTANCE:
                req.draft.acceptance += ACCEPTANCE_RECOVERY
        return False

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """After verifying `req`'s `drafted` tokens, of which the first `accepted` held."""
        state = req.draft
        assert state is not None
        state.verify_steps += 1
        state.drafted += drafted
        state.accepted += accepted
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if not drafted:
            return
        state.acceptance = (
            ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * accepted / drafted
        )
        if accepted == drafted:
            state.length = min(self.num_draft_tokens, 2 * state.length)
        else:
            state.length = max(1, accepted + 1)
        if accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.pause = min(2**state.misses, MAX_BACKOFF_STEPS)

    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class NgramDrafter(Drafter):
    drafts_under_grammar = True

    def propose(self, reqs: list[Req], context_length: int) -> list[list[int]] | None:
        drafts = []
        for req in reqs:
            k = self.draft_length(req, context_length)
            draft = req.draft.index.propose(req.all_ids, k) if k else []
            if draft and req.matcher is not None:
                draft = draft[: req.matcher.validate_tokens(draft)]  # up to one it refuses
            drafts.append(draft)
        return drafts if self.worth_verifying(reqs, drafts) else None


def speculative_usage(req: Req) -> dict[str, float]:
    """A request's drafting figures for its usage; empty when it never verified drafts."""
    state = req.draft
    if state is None or not state.verify_steps:
        return {}
    return {
        "draft_tokens": state.drafted,
        "accepted_draft_tokens": state.accepted,
        # Tokens each verify step emitted: the accepted drafts plus the target's own.
        "accepted_tokens_per_step": round(
            (state.accepted + state.verify_steps) / state.verify_steps, 3
        ),
    }
