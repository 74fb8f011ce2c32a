"""Before serving on a fast attention path, check it against the plain one on this device.

A kernel that is wrong on one GPU (a FlashInfer build for another architecture, a layout
it reads differently) would otherwise serve wrong tokens with no error. At start-up the
model runs a small batch (three prompts of different lengths, then two decode steps) with
both backends on every attention layer: each layer's candidate output must agree with
torch_native's on the same q, k and v within a relative tolerance, and the model goes on
with torch_native's output. So each layer's difference is the kernel's alone. Comparing
the logits instead adds up every layer's rounding: on a 32-layer model with random bf16
weights two right paths differed by 5% at the logits (first H200 run, 2026-11-26), as
much as a kernel 10% off does on a small real model. A candidate that disagrees is not
used: the runner serves torch_native and logs what disagreed. Captured CUDA graphs get a
check after capture: decode steps replayed against eager forwards on the same backend
(the same kernels: the logits must agree, and greedy tokens wherever the eager top two
logits are further apart than twice the largest difference seen), and eager decoding
where they disagree.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.attention.registry import create_attention_backend
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode
from gpu_worker.model_executor.graph_runner import DecodeGraphRunner
from gpu_worker.models.config import ModelConfig

logger = logging.getLogger(__name__)

PROMPT_LENS = (5, 17, 33)
DECODE_STEPS = 2
SAFE_BACKEND = "torch_native"
# Allowed relative error (L2 norm of the difference over that of the expected values) of
# the logits, for graph replays against eager forwards. SmolLM2-135M in bfloat16: two right
# paths 0.4-2%, attention output 10% too large 6-7%, decode missing its newest key 11-53%.
# Float32 leaves summation order only.
FLOAT32_TOLERANCE = 1e-3
LOW_PRECISION_TOLERANCE = 5e-2
# The same for one layer's attention output, candidate against torch_native on the same
# inputs. SmolLM2-135M in bfloat16: right kernels (cpu_kernel, flashinfer_reference)
# 0.33%, wrong ones (10% too large, decode missing its newest key) 10% and 85%.
ATTENTION_FLOAT32_TOLERANCE = 1e-3
ATTENTION_LOW_PRECISION_TOLERANCE = 3e-2


class CheckedRunner(Protocol):
    """What the checks use of the ModelRunner being started: its pools and backends, which
    they swap while they compare, and its eager forward."""

    device: torch.device
    dtype: torch.dtype
    page_size: int
    model_config: ModelConfig
    req_to_token_pool: ReqToTokenPool
    kv_pool: TokenToKVPool
    cpu_kernels: Any
    attn_backend: AttentionBackend
    graph_runner: DecodeGraphRunner | None
    model: torch.nn.Module
    attention_path: str

    def forward_eager(self, forward_batch: ForwardBatch) -> torch.Tensor: ...


@dataclass(frozen=True)
class SelfCheckResult:
    ok: bool
    detail: str


def checked_backend(runner: CheckedRunner, name: str) -> tuple[AttentionBackend, str]:
    """The backend `name` if it passes the check, else torch_native; and a description of
    the path that serves, for the start-up line. The runner serves torch_native meanwhile."""
    safe = create_attention_backend(SAFE_BACKEND, runner.req_to_token_pool, runner.kv_pool)
    runner.attn_backend = safe  # what serves until the candidate passes
    try:
        candidate = create_attention_backend(
            name, runner.req_to_token_pool, runner.kv_pool, runner.cpu_kernels
        )
        result = compare_backends(runner, candidate, safe)
    except Exception as error:  # an import, a kernel build or a launch failing: serve safely
        result = SelfCheckResult(False, f"{type(error).__name__}: {error}")
    if result.ok:
        return candidate, f"{name} (self-check passed: {result.detail})"
    logger.error(
        "attention backend %s disagrees with %s on this device (%s): serving with %s",
        name, SAFE_BACKEND, result.detail, SAFE_BACKEND,
    )  # fmt: skip
    return safe, f"{SAFE_BACKEND} ({name} failed its self-check: {result.detail})"


@torch.inference_mode()
def compare_backends(
    runner: CheckedRunner, candidate: AttentionBackend, reference: AttentionBackend
) -> SelfCheckResult:
    """Run the check batch with both backends on every layer (the candidate first, so it
    reads the K/V it wrote itself; the reference writes the same values after it). Uses
    request rows and slots of an empty pool and leaves the rows as it found them."""
    batch = _extend_batch(runner, seed=0)
    serving = runner.attn_backend
    tolerance = (
        ATTENTION_FLOAT32_TOLERANCE
        if runner.dtype == torch.float32
        else ATTENTION_LOW_PRECISION_TOLERANCE
    )
    both = LayerByLayer(candidate, reference)
    runner.attn_backend = both
    try:
        for step in range(DECODE_STEPS + 1):
            logits = runner.forward_eager(batch)
            if not both.worst_error <= tolerance:  # NaN fails too
                return SelfCheckResult(False, f"forward {step + 1}: attention of layer "
                    f"{both.worst_layer} differs: relative error {both.worst_error:.3g} "
                    f"(tolerance {tolerance:g})")  # fmt: skip
            batch = _next_decode_batch(runner, batch, logits.argmax(dim=-1))
    finally:
        runner.attn_backend = serving
        runner.req_to_token_pool.req_to_token[: len(PROMPT_LENS)] = 0
    forwards = DECODE_STEPS + 1
    return SelfCheckResult(True, f"{forwards} forwards of {len(PROMPT_LENS)} requests agree, "
                                 f"attention within {both.worst_error:.2g}")  # fmt: skip


class LayerByLayer(AttentionBackend):
    """Both backends on each layer's same q, k and v; the model goes on with the
    reference's output. Keeps the largest relative difference and its layer."""

    def __init__(self, candidate: AttentionBackend, reference: AttentionBackend) -> None:
        self.candidate, self.reference = candidate, reference
        self.worst_error, self.worst_layer = 0.0, -1

    def prepare_metadata(self, forward_batch: ForwardBatch) -> None:
        self.candidate.prepare_metadata(forward_batch)
        self.reference.prepare_metadata(forward_batch)

    def forward(self, q, k, v, layer, forward_batch: ForwardBatch) -> torch.Tensor:
        got = self.candidate.forward(q, k, v, layer, forward_batch).float()
        expected = self.reference.forward(q, k, v, layer, forward_batch)
        error = _relative_error(got, expected.float())
        if not error <= self.worst_error and self.worst_error == self.worst_error:
            self.worst_error, self.worst_layer = error, layer.layer_id  # a NaN stays worst
        return expected


@torch.inference_mode()
def check_new_weights(runner: CheckedRunner, model: torch.nn.Module) -> SelfCheckResult:
    """New weights' check before they serve (gpu_worker/model_executor/weight_swap.py): the
    check batch through `model` on the serving backend, every logit finite, and where that
    backend is not torch_native, agreeing with it as at start-up. Needs an empty KV pool
    (the worker has drained and flushed its prefix cache): it writes pages from 1 on."""
    serving = runner.model
    runner.model = model
    try:
        if runner.attention_path.startswith(SAFE_BACKEND):
            return _finite_forwards(runner)
        safe = create_attention_backend(SAFE_BACKEND, runner.req_to_token_pool, runner.kv_pool)
        result = compare_backends(runner, runner.attn_backend, safe)
        return _finite_forwards(runner) if result.ok else result
    finally:
        runner.model = serving


def _finite_forwards(runner: CheckedRunner) -> SelfCheckResult:
    batch = _extend_batch(runner, seed=2)
    try:
        for step in range(DECODE_STEPS + 1):
            logits = runner.forward_eager(batch).float()
            if not torch.isfinite(logits).all():
                return SelfCheckResult(False, f"forward {step + 1}: logits not finite")
            batch = _next_decode_batch(runner, batch, logits.argmax(dim=-1))
    finally:
        runner.req_to_token_pool.req_to_token[: len(PROMPT_LENS)] = 0
    return SelfCheckResult(True, f"{DECODE_STEPS + 1} forwards, finite logits")


def verified_graphs(runner: CheckedRunner, graphs: DecodeGraphRunner) -> DecodeGraphRunner | None:
    """`graphs` if their replays agree with eager decoding, else None (eager), logged."""
    runner.graph_runner = graphs
    try:
        result = check_graph_replay(runner)
    except Exception as error:  # a replay that fails: decode eager
        result = SelfCheckResult(False, f"{type(error).__name__}: {error}")
    finally:
        runner.graph_runner = None
    if result.ok:
        return graphs
    logger.error("CUDA graph replays disagree with eager decoding (%s): decoding eager",
                 result.detail)  # fmt: skip
    return None


@torch.inference_mode()
def check_graph_replay(runner: CheckedRunner) -> SelfCheckResult:
    """Decode steps of the check batch through the runner's CUDA graphs against eager
    forwards on the same backend (itself checked against torch_native before capture)."""
    batch = _extend_batch(runner, seed=1)
    try:
        tokens = runner.forward_eager(batch).argmax(dim=-1)
        for step in range(DECODE_STEPS):
            batch = _next_decode_batch(runner, batch, tokens)
            got = runner.graph_runner.run(batch).float()
            expected = runner.forward_eager(batch).float()
            problem = _disagreement(got, expected, runner.dtype)
            if problem:
                return SelfCheckResult(False, f"decode step {step + 1}: {problem}")
            tokens = expected.argmax(dim=-1)
    finally:
        runner.req_to_token_pool.req_to_token[: len(PROMPT_LENS)] = 0
    return SelfCheckResult(True, f"{DECODE_STEPS} decode steps agree with eager")


def _disagreement(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    tolerance = FLOAT32_TOLERANCE if dtype == torch.float32 else LOW_PRECISION_TOLERANCE
    error = _relative_error(got, expected)
    if not error <= tolerance:  # NaN fails too
        return f"logits differ: relative error {error:.3g} (tolerance {tolerance:g})"
    # Two logits closer than twice the largest difference may swap places legitimately.
    worst = (got - expected).abs().max().item()
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * worst
    differs = clear & (got.argmax(dim=-1) != expected.argmax(dim=-1))
    if differs.any():
        return f"greedy tokens differ in rows {differs.nonzero().flatten().tolist()}"
    return None


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _extend_batch(runner: CheckedRunner, seed: int) -> ForwardBatch:
    """Prefill of random prompts of PROMPT_LENS tokens in rows 0.. of the request table,
    each request on fresh pages from page 1 on, with room for the decode steps."""
    rng = random.Random(seed)
    vocab = runner.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]
    page, device = runner.page_size, runner.device
    slots, next_page = [], 1
    for row, prompt in enumerate(prompts):
        room = len(prompt) + DECODE_STEPS
        own = torch.arange(next_page * page, next_page * page + room, device=device)
        runner.req_to_token_pool.req_to_token[row, :room] = own
        slots.append(own[: len(prompt)])
        next_page += -(-room // page)
    lens = [len(p) for p in prompts]
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(prompts),
        input_ids=torch.tensor([t for p in prompts for t in p], device=device),
        positions=torch.cat([torch.arange(n, device=device) for n in lens]),
        req_pool_indices=torch.arange(len(prompts), device=device),
        seq_lens=torch.tensor(lens, device=device),
        out_cache_loc=torch.cat(slots),
        seq_lens_cpu=lens,
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=[0] * len(prompts),
    )


def _next_decode_batch(
    runner: CheckedRunner, batch: ForwardBatch, tokens: torch.Tensor
) -> ForwardBatch:
    """One decode step after `batch`: each request's next token at its next position."""
    lens = batch.seq_lens_cpu
    positions = torch.tensor(lens, device=tokens.device)
    table = runner.req_to_token_pool.req_to_token
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=batch.batch_size,
        input_ids=tokens,
        positions=positions,
        req_pool_indices=batch.req_pool_indices,
        seq_lens=positions + 1,
        out_cache_loc=table[batch.req_pool_indices, positions],
        seq_lens_cpu=[n + 1 for n in lens],
        extend_seq_lens_cpu=[1] * batch.batch_size,
        extend_prefix_lens_cpu=list(lens),
    )
