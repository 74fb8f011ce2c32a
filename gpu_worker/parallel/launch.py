"""Rank 0 of a tensor-parallel worker: start the followers, lead them, stop them.

Rank 0 is the worker process itself: it alone runs the scheduler, samples and talks to the
bus. It spawns ranks 1..tp-1 (fresh interpreters: `spawn`, as CUDA and a forked torch do not
mix), each with a pipe on which rank 0 sends every forward it runs (step_message.py); the
model's own collectives are the only traffic back. A pipe, not a collective, carries the
steps so that an idle worker's followers wait on nothing with a timeout.

The worker lives and dies as one:
- A follower that dies (crashes, is killed, fails to load) takes rank 0 down: a watchdog
  thread waits on the followers' process sentinels and ends rank 0 with `EXIT_RANK_DIED`, at
  once, even if rank 0 is blocked in a collective the dead rank will never join (NCCL would
  wait forever). The worker's heartbeat then lapses and its jobs migrate, as after any
  worker death. (In-process `Engine` users get the same: their process exits.)
- Rank 0 ending, in any way, ends the followers: each watches rank 0's sentinel
  (follower.py), and they are daemonic, so a normal exit terminates them too.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
from collections.abc import Callable
from typing import NoReturn

import torch

from gpu_worker.config import EngineConfig
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.model_executor.forward_batch import ForwardBatch
from gpu_worker.parallel.group import join_group, leave_group, share_cpu_threads
from gpu_worker.parallel.shard import TPShard, check_tp
from gpu_worker.parallel.step_message import StepMessage

logger = logging.getLogger(__name__)

EXIT_RANK_DIED = 70  # a tensor-parallel rank died: the worker exits as one (sysexits' SOFTWARE)
STOP = ("stop", None)
STOP_WAIT_S = 10.0
# How long a failed step waits for a follower's death to show, to say which rank ended it.
DEATH_NOTICE_S = 1.0


class TensorParallelLeader:
    """Rank 0's handle on the followers: `run_step` for each forward, `stop` at the end."""

    def __init__(self, config: EngineConfig, runner_class: type) -> None:
        """Start ranks 1..tp-1, each building a `runner_class` (ModelRunner) over its share,
        and join them as rank 0."""
        from gpu_worker.models.loader import load_model_config

        # Checked before anything starts: a bad tp is an error at start, not a hang. This
        # also converts a GGUF file once, before the followers look for the cached folder.
        check_tp(load_model_config(config.model), config.tp)
        device = config.torch_device()
        self._threads = torch.get_num_threads()  # given back at stop (an Engine's process)
        share_cpu_threads(device, config.tp)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        from gpu_worker.parallel.follower import follower_main

        self._stopping = threading.Event()
        self.followers: list[multiprocessing.process.BaseProcess] = []
        self.pipes: list[multiprocessing.connection.Connection] = []
        for rank in range(1, config.tp):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=follower_main,
                args=(config, rank, init_method, theirs, runner_class),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.followers.append(process)
            self.pipes.append(ours)
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        # A process that ends without Engine.shutdown (the worker's CLI returns from its loop)
        # stops the followers first: multiprocessing's own exit handler, which runs after
        # this one, would terminate them under the watchdog's eyes.
        atexit.register(self.stop)
        self.group = join_group(TPShard(0, config.tp), init_method, device)
        logger.info("tensor parallel: rank 0 of %d joined (%s)", config.tp, init_method)

    def run_step(
        self,
        batch: ForwardBatch,
        pool: ReqToTokenPool,
        forward: Callable[[ForwardBatch], torch.Tensor],
    ) -> torch.Tensor:
        """Send `batch` to every follower, then run `forward(batch)` here, all ranks meeting
        in its collectives. Once the followers have the step, a failure ends the worker, not
        just the batch's requests: if a follower died (a broken pipe, a collective whose peer
        left) the worker cannot step without it, and if rank 0's forward raised part-way the
        followers wait in a collective it left, so the ranks are out of step for good."""
        message = ("step", StepMessage.of(batch, pool))  # a failure here is the batch's alone
        try:
            for pipe in self.pipes:
                pipe.send(message)
            return forward(batch)
        except Exception:
            dead = self._dead_follower(within_s=DEATH_NOTICE_S)
            if dead is not None:
                self._exit_for(dead)
            logger.critical("tensor parallel: rank 0's forward raised after the followers "
                            "began it; the worker exits as one", exc_info=True)  # fmt: skip
            os._exit(EXIT_RANK_DIED)

    def _dead_follower(self, within_s: float) -> multiprocessing.process.BaseProcess | None:
        sentinels = {process.sentinel: process for process in self.followers}
        ready = multiprocessing.connection.wait(list(sentinels), timeout=within_s)
        return sentinels[ready[0]] if ready else None

    def _exit_for(self, dead: multiprocessing.process.BaseProcess) -> NoReturn:
        logger.critical(
            "tensor parallel: %s died (exit code %s)%s; the worker exits as one",
            dead.name, dead.exitcode, self._last_words(dead),
        )  # fmt: skip
        os._exit(EXIT_RANK_DIED)

    def stop(self) -> None:
        """End the followers and leave the group; the watchdog stands down first."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        atexit.unregister(self.stop)
        for pipe in self.pipes:
            try:
                pipe.send(STOP)
            except OSError:
                pass  # already gone
        for process in self.followers:
            process.join(STOP_WAIT_S)
            if process.is_alive():
                process.kill()
                process.join()
        leave_group()
        torch.set_num_threads(self._threads)

    def _watch(self) -> None:
        while not self._stopping.is_set():
            dead = self._dead_follower(within_s=0.5)
            if dead is not None and not self._stopping.is_set():
                self._exit_for(dead)

    def _last_words(self, dead: multiprocessing.process.BaseProcess) -> str:
        """The error a follower sent before it ended, if it sent one."""
        pipe = self.pipes[self.followers.index(dead)]
        try:
            if pipe.poll(0.1):
                kind, text = pipe.recv()
                if kind == "error":
                    return f": {text}"
        except (EOFError, OSError):
            pass
        return ""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
