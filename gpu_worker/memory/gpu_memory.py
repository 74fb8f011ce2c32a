"""How many KV tokens a GPU can hold once weights, activations and CUDA graphs have theirs.

Pure arithmetic on figures the caller reads (torch.cuda.mem_get_info after the weights
load), so the CPU suite checks it with made-up GPUs. The rule, as SGLang's
`mem_fraction_static`: weights plus the KV pool take at most that share of the device, the
rest is headroom. Here the headroom is also never less than what a forward can need at
its largest (the activations of a full prefill chunk, the logits of a full decode or
verify batch, FlashInfer's workspace) plus the captured graphs' memory pool, so a
fraction set too high gives a smaller pool, not an out-of-memory error mid-request.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.models.config import ModelConfig

# FlashInfer's float workspace (flashinfer_backend.WORKSPACE_BYTES), and what the CUDA
# context, cuBLAS workspaces and the allocator's fragmentation take beyond our own tensors.
ATTENTION_WORKSPACE_BYTES = 128 * 2**20
SAFETY_BYTES = 512 * 2**20


def forward_activation_bytes(
    config: ModelConfig, dtype_bytes: int, tokens: int, logit_rows: int
) -> int:
    """Peak memory of one forward over `tokens` new tokens with logits for `logit_rows`:
    the largest layer's live tensors (residual stream, normed input, fused qkv, attention
    output, fused gate/up and the activated half) and the float32 logits, computed in the
    model dtype and converted (both live at once)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    attention_out = config.num_attention_heads * config.head_dim
    per_token = 3 * hidden + qkv + attention_out + 2 * inter + inter
    logits = logit_rows * config.vocab_size * (dtype_bytes + 4)
    return tokens * per_token * dtype_bytes + logits


@dataclass(frozen=True)
class GpuMemoryPlan:
    kv_tokens: int  # what the KV pool holds (a whole number of pages)
    kv_bytes: int
    headroom_bytes: int  # left for activations, graphs and the rest


def plan_gpu_kv_pool(
    total_bytes: int,  # the device's memory
    free_bytes: int,  # free now, with the weights loaded
    mem_fraction_static: float,
    kv_bytes_per_token: int,
    peak_activation_bytes: int,  # forward_activation_bytes of the largest forward
    graph_pool_bytes: int,  # what captured CUDA graphs keep (0 without graphs)
    page_size: int,
) -> GpuMemoryPlan:
    """Size the KV pool; ValueError, with the figures, when not even one page fits."""
    needed = peak_activation_bytes + graph_pool_bytes + ATTENTION_WORKSPACE_BYTES + SAFETY_BYTES
    headroom = max(int(total_bytes * (1 - mem_fraction_static)), needed)
    tokens = max(free_bytes - headroom, 0) // kv_bytes_per_token
    tokens -= tokens % page_size
    if tokens < page_size:
        gib = 2**30
        raise ValueError(
            f"no room for a KV pool: {free_bytes / gib:.2f} GiB free after the weights, "
            f"{headroom / gib:.2f} GiB kept for activations ({peak_activation_bytes / gib:.2f}), "
            f"CUDA graphs ({graph_pool_bytes / gib:.2f}) and workspaces; lower "
            "chunked_prefill_size or max_running_requests, capture fewer graphs, or use a "
            "larger GPU"
        )
    return GpuMemoryPlan(tokens, tokens * kv_bytes_per_token, headroom)
