"""The tensor-parallel process group of this process, and the collectives the model runs.

One group per process, set once when the process joins (launch.py on rank 0, follower.py on
the others) and left at shutdown: the model's layers reach it through `tp_group()` rather
than through their arguments, as every forward of a split model runs the same collectives.

Collectives go over NCCL on CUDA; on CPU over shared memory (shm_collectives.py) where the
host allows it, else gloo. The KV-pool agreement and other small host-side exchanges use
`cpu_group` (gloo either way, so no device sync is needed for them).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpu_worker.parallel.shard import TPShard
from gpu_worker.parallel.shm_collectives import (
    SharedMemoryCollectives,
    mapping_path,
    shared_memory_usable,
)

# How long a collective waits for a rank that does not arrive. A dead rank is noticed
# sooner by the watchdogs (launch.py, follower.py); this only bounds a stuck one.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TPGroup:
    shard: TPShard
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    shared: SharedMemoryCollectives | None = None  # CPU ranks on an x86-64 host

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; every rank gets the same sum."""
        if self.shared is not None and self.shared.fits(tensor):
            return self.shared.all_reduce(tensor)
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` side by side along the last axis (rank order)."""
        if self.shared is not None and self.shared.fits(tensor):
            return self.shared.all_gather_last_dim(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of each rank's `value` (e.g. the KV tokens each rank's memory fits)."""
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(box.item())


_group: TPGroup | None = None


def join_group(shard: TPShard, init_method: str, device: torch.device) -> TPGroup:
    """Join the process group as `shard.rank` (blocks until every rank has joined)."""
    global _group
    if _group is not None:
        raise RuntimeError("this process is already in a tensor-parallel group")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # NCCL runs on the current device
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=shard.rank,
        world_size=shard.size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo")
    shared = _map_shared_memory(shard, cpu_group) if device.type == "cpu" else None
    _group = TPGroup(shard, world, cpu_group, shared)
    return _group


def _map_shared_memory(
    shard: TPShard, cpu_group: dist.ProcessGroup
) -> SharedMemoryCollectives | None:
    """Rank 0 decides (so all ranks agree) and names a fresh mapping, every rank maps it,
    then rank 0 unlinks the file (the mappings stay): nothing is left in /dev/shm however
    the ranks end. None: the host cannot, and gloo carries the collectives."""
    usable = shard.rank == 0 and shared_memory_usable(shard.size)
    path = [mapping_path() if usable else None]
    dist.broadcast_object_list(path, src=0, group=cpu_group)
    if path[0] is None:
        return None
    if shard.rank == 0:
        shared = SharedMemoryCollectives(path[0], shard.rank, shard.size)
    dist.barrier(group=cpu_group)  # the file exists, at its full size
    if shard.rank != 0:
        shared = SharedMemoryCollectives(path[0], shard.rank, shard.size)
    dist.barrier(group=cpu_group)  # every rank has mapped it
    if shard.rank == 0:
        os.unlink(path[0])
    return shared


def tp_group() -> TPGroup:
    if _group is None:
        raise RuntimeError(
            "no tensor-parallel group: a split model runs in a ModelRunner with tp > 1, "
            "which joins one (gpu_worker/parallel/launch.py)"
        )
    return _group


def leave_group() -> None:
    global _group
    if _group is not None:
        _group = None
        dist.destroy_process_group()


def share_cpu_threads(device: torch.device, tp: int) -> None:
    """On CPU, give each rank its share of the cores: tp ranks each using every core would
    fight over them (the ranks run their matmuls at the same time, then meet)."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
