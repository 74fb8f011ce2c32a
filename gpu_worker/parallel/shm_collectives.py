"""All-reduce and all-gather between the CPU ranks of one host through shared memory.

Gloo's all-reduce goes through TCP: on this 2-core host one call took 0.5-0.7 ms, whatever
the size, mostly waking the peer (benchmarks/NOTES.md), and a SmolLM2 step makes 62 of them
(two per layer, the embedding's, the logits' gather). Here each rank copies its tensor into
its slot of a shared file mapping, publishes a sequence number, waits (spinning) until every
rank has published the same number, and sums (or concatenates) the slots itself, in rank
order, so every rank gets bit-identical results.

Slots come in two sets used in turn: a rank that reaches call n + 2 (and writes its slot of
call n's set again) has seen every rank publish call n + 1, which each does only after it has
read call n. So one wait per call is enough.

The waiting spins at first (while a forward runs each rank has its cores, and the peers
arrive within the ranks' skew), then yields the CPU, then sleeps in short naps: on a host
whose cores are taken by others a spinning rank would hold up the very peer it waits for. A
tensor larger than a slot, or a CUDA tensor, goes through the process group instead (the
choice depends only on shapes, which every rank has alike). The ordering argument needs
x86's stores seen in program order (a slot's bytes, then the sequence number), so the
mapping is only used on x86-64.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

SLOT_BYTES = 8 * 2**20  # a [3640, 576] float32 prefill's hidden states; logits of ~85 rows
_FLAG_STRIDE = 8  # int64s per rank's sequence number: one 64-byte cache line each
_SPIN_S = 50e-6  # then yield
_YIELD_S = 1e-3  # then nap
_NAP_S = 50e-6


def shared_memory_usable(size: int) -> bool:
    """x86-64 with room in /dev/shm for `size` ranks' slots (a container's is often 64 MiB,
    and touching a mapping past a full tmpfs kills the process), unless
    STREAMSERVE_TP_SHARED_MEMORY=0 (then gloo: it sleeps where this spins, which a host whose
    cores are all taken by others may prefer)."""
    if os.environ.get("STREAMSERVE_TP_SHARED_MEMORY", "1") == "0":
        return False
    if platform.machine() not in ("x86_64", "AMD64") or not Path("/dev/shm").is_dir():
        return False
    room = os.statvfs("/dev/shm")
    return room.f_bavail * room.f_frsize >= 2 * _mapping_bytes(size)


def _mapping_bytes(size: int) -> int:
    return 8 * _FLAG_STRIDE * size + 2 * size * SLOT_BYTES


def mapping_path() -> str:
    return f"/dev/shm/streamserve-tp-{os.getpid()}-{os.urandom(4).hex()}"


class SharedMemoryCollectives:
    def __init__(self, path: str, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        flag_bytes = 8 * _FLAG_STRIDE * size
        total = _mapping_bytes(size)
        # Rank 0 creates (and zeroes) the file; the others map it; rank 0 unlinks it once all
        # have, so nothing is left behind however the ranks end.
        self.memory = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self.flags = self.memory[:flag_bytes].view(torch.int64).numpy()[::_FLAG_STRIDE]
        self.slots = self.memory[flag_bytes:].view(2, size, SLOT_BYTES)
        self.calls = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= SLOT_BYTES

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (rank order: the same bits on every rank)."""
        parts = self._exchange(tensor)
        tensor.copy_(parts[0])
        for part in parts[1:]:
            tensor.add_(part)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=-1)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor`, as views of the slots (valid until the call after next)."""
        self.calls += 1
        slots = self.slots[self.calls % 2]
        nbytes = tensor.numel() * tensor.element_size()
        views = [slot[:nbytes].view(tensor.dtype).view(tensor.shape) for slot in slots]
        views[self.rank].copy_(tensor)
        self.flags[self.rank] = self.calls  # published after the slot's bytes (x86 order)
        if self.flags.min() < self.calls:
            self._wait_for_peers()
        return views

    def _wait_for_peers(self) -> None:
        started = time.perf_counter()
        while self.flags.min() < self.calls:
            waited = time.perf_counter() - started
            if waited > _YIELD_S:
                time.sleep(_NAP_S)
            elif waited > _SPIN_S:
                os.sched_yield()
