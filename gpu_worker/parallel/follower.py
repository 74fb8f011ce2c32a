"""Ranks 1..tp-1 of a tensor-parallel worker: load a share of the model, then run every
forward rank 0 sends, until it says stop.

A follower has a ModelRunner of its own (its share of the weights, a KV pool of its heads,
its own request rows) and no scheduler: rank 0 decides everything, and a step message
carries the ForwardBatch and the request-row writes made since the last one
(step_message.py). The logits a follower computes are gathered by rank 0 inside the model;
the follower drops its copy.

It ends when rank 0 says stop, when its pipe closes, or when rank 0's process is gone (a
watchdog thread, since a rank blocked in a collective with a dead peer may never return).
Ctrl-C is rank 0's to handle: a follower ignores SIGINT, which a terminal sends to every
process of the foreground group.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import traceback

import torch

from gpu_worker.config import EngineConfig
from gpu_worker.parallel.group import join_group, leave_group, share_cpu_threads
from gpu_worker.parallel.shard import TPShard

logger = logging.getLogger(__name__)

EXIT_LEADER_GONE = 1


def follower_main(
    config: EngineConfig,
    rank: int,
    init_method: str,
    pipe: multiprocessing.connection.Connection,
    runner_class: type,
) -> None:
    """A follower process's whole life. `runner_class` is ModelRunner, passed in by rank 0
    (which has it already) rather than imported here: ModelRunner starts this module's
    leader, launch.py."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(name)s %(message)s"
    )
    threading.Thread(target=_end_with_leader, name="leader-watch", daemon=True).start()
    try:
        runner = _start(config, rank, init_method, runner_class)
    except BaseException:
        pipe.send(("error", traceback.format_exc(limit=-3)))
        raise
    _serve(runner, pipe)


def _start(config: EngineConfig, rank: int, init_method: str, runner_class: type):
    device = follower_device(config, rank)
    share_cpu_threads(device, config.tp)
    join_group(TPShard(rank, config.tp), init_method, device)
    if device.type == "cuda":
        config = dataclasses.replace(config, device=str(device))
    return runner_class(config, tp_rank=rank)


def _serve(runner, pipe: multiprocessing.connection.Connection) -> None:
    try:
        while True:
            try:
                kind, message = pipe.recv()
            except EOFError:
                sys.exit(EXIT_LEADER_GONE)
            if kind == "stop":
                return
            message.apply_row_writes(runner.req_to_token_pool)
            runner.forward_eager(message.forward_batch(runner.device))
    finally:
        runner.forward_hooks.remove()
        leave_group()


def follower_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the next GPU after rank 0's, or the CPU."""
    device = config.torch_device()
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _end_with_leader() -> None:
    leader = multiprocessing.parent_process()
    if leader is None:
        return
    multiprocessing.connection.wait([leader.sentinel])
    os._exit(EXIT_LEADER_GONE)
