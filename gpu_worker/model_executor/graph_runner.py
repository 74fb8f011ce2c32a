"""Decode through CUDA graphs: batches padded to a captured size, inputs in static buffers.

A CUDA graph replays the kernels it recorded on the tensors it recorded, so every decode
step writes its inputs into the same buffers (token ids, positions, request rows, sequence
lengths, KV slots) and reads its logits from the same output. One graph per batch size in
a list (captured largest first, so the smaller ones fit in the memory pool of the first);
a batch is padded up to the next captured size and its logits cut back; a batch larger
than the largest size runs eager. Padding rows are harmless by construction: each is a
one-key request that writes its K/V into slot 0 of the padding page (which no request
owns) and reads row 0's first slot, and its logits are dropped.

The bucketing, padding and buffers are device-agnostic and run on CPU in the suite, where
a forward over the static buffers stands in for `graph.replay()`. The capture needs an
attention backend that prepares its metadata into fixed buffers (`init_capture_graph`,
`prepare_for_replay`): the FlashInfer backend does, through FlashInfer's CUDA-graph
wrappers (with its reference kernel on CPU, so the suite runs that path too); the others
raise NotImplementedError, and the engine decodes eager.
"""

from __future__ import annotations

import bisect
from typing import Protocol

import torch

from gpu_worker.attention.base import AttentionBackend
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode

# SGLang's default list, up to the scheduler's batch limit: dense where batches are small.
DEFAULT_CAPTURE_SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]


def capture_sizes(max_running_requests: int, sizes: list[int] | None = None) -> list[int]:
    """The batch sizes to capture, ascending: those of `sizes` up to the batch limit, and
    the limit itself, so every batch the scheduler forms has a graph."""
    chosen = {size for size in (sizes or DEFAULT_CAPTURE_SIZES) if size < max_running_requests}
    return sorted(chosen | {max_running_requests})


class GraphedModel(Protocol):
    """What the graph runner needs of the ModelRunner that owns it: the forward a graph
    records, the eager one it falls back to, and the backend that prepares each replay."""

    device: torch.device
    attn_backend: AttentionBackend

    def forward_eager(self, forward_batch: ForwardBatch) -> torch.Tensor: ...

    def forward_captured(self, forward_batch: ForwardBatch) -> torch.Tensor: ...


class DecodeGraphRunner:
    def __init__(self, runner: GraphedModel, sizes: list[int]) -> None:
        if not sizes or sorted(set(sizes)) != sizes or sizes[0] < 1:
            raise ValueError(f"capture sizes must be ascending positive ints, got {sizes}")
        self.runner = runner
        self.sizes = sizes
        largest, device = sizes[-1], runner.device
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros(largest, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # Whether the attention backend prepares its metadata into fixed buffers, which a
        # capture needs; the reason where it does not.
        self.unsupported: str | None = None
        try:
            runner.attn_backend.init_capture_graph(largest)
        except NotImplementedError as reason:
            self.unsupported = str(reason)

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest captured size that holds the batch; None past the largest."""
        index = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[index] if index < len(self.sizes) else None

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (
            forward_batch.forward_mode == ForwardMode.DECODE
            and self.padded_size(forward_batch.batch_size) is not None
        )

    def run(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a decode batch, through the graph of its padded size. On
        CPU a forward on the static buffers stands in for the replay: with the metadata
        prepared into the backend's fixed buffers where it has them, as a replay reads it."""
        padded = self.padded_batch(forward_batch)
        if self.unsupported is not None:
            return self.runner.forward_eager(padded)[: forward_batch.batch_size]
        self.runner.attn_backend.prepare_for_replay(padded)
        graph = self.graphs.get(padded.batch_size)
        if graph is None:
            return self.runner.forward_captured(padded)[: forward_batch.batch_size]
        graph.replay()
        return self.outputs[padded.batch_size][: forward_batch.batch_size]

    def padded_batch(self, forward_batch: ForwardBatch) -> ForwardBatch:
        """Copy the batch into the static buffers and pad it with one-key requests."""
        bs = forward_batch.batch_size
        padded = self.padded_size(bs)
        if padded is None:
            raise ValueError(f"batch of {bs} is larger than the largest captured size")
        for buffer, values, pad in (
            (self.input_ids, forward_batch.input_ids, 0),
            (self.positions, forward_batch.positions, 0),
            (self.req_pool_indices, forward_batch.req_pool_indices, 0),
            (self.seq_lens, forward_batch.seq_lens, 1),
            (self.out_cache_loc, forward_batch.out_cache_loc, 0),  # the padding page's slot
        ):
            buffer[:bs].copy_(values)
            buffer[bs:padded].fill_(pad)
        extra = padded - bs
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=padded,
            input_ids=self.input_ids[:padded],
            positions=self.positions[:padded],
            req_pool_indices=self.req_pool_indices[:padded],
            seq_lens=self.seq_lens[:padded],
            out_cache_loc=self.out_cache_loc[:padded],
            seq_lens_cpu=forward_batch.seq_lens_cpu + [1] * extra,
            extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu + [1] * extra,
            extend_prefix_lens_cpu=forward_batch.extend_prefix_lens_cpu + [0] * extra,
        )

    def capture(self) -> None:
        """Record one graph per size, largest first, in one memory pool (CUDA only)."""
        if self.runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        if self.unsupported is not None:
            raise NotImplementedError(self.unsupported)
        backend = self.runner.attn_backend
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            batch = self.padded_batch(_empty_decode_batch(size, self.runner.device))
            for _ in range(2):  # warm up: lazy inits and autotuning stay out of the graph
                self.runner.forward_eager(batch)
            backend.prepare_for_capture(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.runner.forward_captured(batch)
            self.graphs[size] = graph


def _empty_decode_batch(size: int, device: torch.device) -> ForwardBatch:
    zeros = torch.zeros(size, dtype=torch.int64, device=device)
    return ForwardBatch(
        ForwardMode.DECODE, size, zeros, zeros, zeros, zeros + 1, zeros,
        [1] * size, [1] * size, [0] * size,
    )  # fmt: skip
