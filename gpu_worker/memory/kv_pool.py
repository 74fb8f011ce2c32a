"""TokenToKVPool: the K and V tensors of every layer, indexed by KV slot.

The pool knows nothing about requests or pages in use; the allocator decides which slots
are free and ReqToTokenPool says which slots a request reads.
"""

from __future__ import annotations

import math
import mmap

import torch


class TokenToKVPool:
    """Per-layer K and V buffers indexed by KV slot. Slots [0, page_size) are a padding page that
    is never handed out: padded batch entries write there harmlessly.

    Buffers are head-major, [kv_heads, slots, head_dim]: gathering one head's keys for a
    batch gives a contiguous [tokens, head_dim] block that a batched matmul takes as it is
    (with slot-major storage the gathered keys are strided and every matmul copies them)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
    ) -> None:
        if page_size < 1 or size < page_size or size % page_size:
            raise ValueError(f"size {size} must be a positive multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        shape = (num_kv_heads, size + page_size, head_dim)
        # One tensor per layer (not one [layers, ...] tensor) so a layer's buffer is contiguous
        # and attention kernels can take it without a stride argument.
        self.k_buffer = [zeroed(shape, dtype, self.device) for _ in range(num_layers)]
        self.v_buffer = [zeroed(shape, dtype, self.device) for _ in range(num_layers)]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v ([T, kv_heads, head_dim], or the projections' [T, kv_heads * head_dim])
        at slots loc ([T]), cast to the pool dtype."""
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if k.dtype != self.dtype:
            k = k.to(self.dtype)
        if v.dtype != self.dtype:
            v = v.to(self.dtype)
        self.k_buffer[layer_id][:, loc] = k.transpose(0, 1)
        self.v_buffer[layer_id][:, loc] = v.transpose(0, 1)

    @staticmethod
    def bytes_per_token(
        dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int
    ) -> int:
        """Bytes one token's K and V take over all layers (for sizing the pool from a budget)."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def total_bytes(self) -> int:
        per_token = self.bytes_per_token(
            self.dtype, self.num_layers, self.num_kv_heads, self.head_dim
        )
        return (self.size + self.page_size) * per_token


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On CPU it lies in fresh anonymous memory, which the kernel maps
    to zeroed pages only as they are first written: a pool costs memory as its slots fill,
    and nothing at start-up. torch.zeros wrote every byte, which for the CPU default of 2
    GB was ~0.5 s of each worker's start and the whole pool resident before any request;
    torch.empty would not write it, but what an allocator hands back may hold old bytes,
    and a kernel that reads a block past a request's keys must find finite values there."""
    count = math.prod(shape)
    if device.type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, count * dtype.itemsize)  # the tensor keeps it alive
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)


def check_fits_in_memory(nbytes: int) -> None:
    """Refuse a CPU pool larger than the memory this machine has available: its pages are
    taken only as slots fill (`zeroed`), so without this such a pool would start and the
    worker be killed for memory later, under load, with its requests."""
    available = _available_memory_bytes()
    if available is not None and nbytes > available:
        raise ValueError(
            f"the KV pool would take {nbytes / 2**30:.1f} GiB and this machine has "
            f"{available / 2**30:.1f} GiB available: lower kv_cache_memory_gb (or "
            "max_total_tokens)"
        )


def _available_memory_bytes() -> int | None:
    """Linux's estimate of the memory that can be taken without swapping (MemAvailable),
    or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
