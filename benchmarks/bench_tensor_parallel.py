"""Step times of one engine under --tp 1 and --tp N, and what the collectives take of them.

    python benchmarks/bench_tensor_parallel.py [--tp 2] [--batch 1,16] [--out f.jsonl]

For each tp: a prefill of one 256-token prompt, then decode steps of `batch` requests (32
steps, after 24 to warm up), each step timed on rank 0 around `scheduler.step()`, which
includes sending the step to the followers. Rank 0's time inside the model's all-reduces and
the logits' all-gather is timed too: it is the collectives' own cost plus the wait for the
slower rank. Then the all-reduce alone, between two idle processes, over gloo and over
shared memory (what CPU ranks use, parallel/shm_collectives.py), for the shapes a step
reduces ([rows, hidden] float32): its latency with no skew to wait out. One
JSON line per (tp, step kind) and per all-reduce shape. Run on an otherwise idle machine:
on two cores, two ranks will not be faster than one (each rank gets half the cores).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_args import engine_parser, parse_engine_args  # noqa: E402
from benchmarks.jsonl import emit, machine  # noqa: E402
from gpu_worker import Engine  # noqa: E402
from gpu_worker.model_executor.forward_mode import ForwardMode  # noqa: E402
from gpu_worker.parallel.group import TPGroup  # noqa: E402

PROMPT_TOKENS = 256
WARMUP_STEPS = 24
TIMED_STEPS = 32


class CollectiveClock:
    """Seconds rank 0 spends in the group's collectives (wrapped for the run)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._originals = {}
        for name in ("all_reduce", "all_gather_last_dim"):
            original = getattr(TPGroup, name)
            self._originals[name] = original
            setattr(TPGroup, name, self._timed(original))

    def _timed(self, original):
        def timed(group, tensor):
            started = time.perf_counter()
            try:
                return original(group, tensor)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        return timed

    def take(self) -> tuple[float, int]:
        taken = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return taken


def _requests(engine: Engine, prompts: list[list[int]], max_new: int) -> None:
    params = engine.sampling_params({"temperature": 0, "max_new_tokens": max_new,
                                     "ignore_eos": True}, len(prompts[0]))  # fmt: skip
    for i, ids in enumerate(prompts):
        engine.scheduler.add_request(engine.build_request(f"r{i}", ids, params))


def _timed_steps(engine: Engine, clock: CollectiveClock, mode: ForwardMode, count: int):
    step_s, collective_s, calls = [], [], 0
    for _ in range(count):
        clock.take()
        started = time.perf_counter()
        engine.scheduler.step()
        elapsed = time.perf_counter() - started
        assert engine.scheduler.last_mode == mode, engine.scheduler.last_mode
        seconds, calls = clock.take()
        step_s.append(elapsed)
        collective_s.append(seconds)
    return statistics.median(step_s), statistics.median(collective_s), calls


def measure(args, tp: int, batch: int, clock: CollectiveClock) -> None:
    options = {"dtype": args.dtype, "tp": tp, "max_total_tokens": 16384,
               "max_running_requests": max(batch, 1)}  # fmt: skip
    with Engine(args.model, **options) as engine:
        base = {"model": args.model, "dtype": args.dtype, "tp": tp, "machine": machine()}
        prompt = [(i * 7919) % 400 + 10 for i in range(PROMPT_TOKENS)]
        for run in range(3):  # the first prefill warms up; the last two are timed
            _requests(engine, [prompt[run:] + [run]], 1)
            timed = _timed_steps(engine, clock, ForwardMode.EXTEND, 1)
            while engine.scheduler.has_work():
                engine.scheduler.step()
        emit(_row(base, f"prefill-{PROMPT_TOKENS}", *timed), args.out)
        prompts = [[(i * 31 + j) % 400 + 10 for j in range(32)] for i in range(batch)]
        _requests(engine, prompts, WARMUP_STEPS + TIMED_STEPS + 2)
        engine.scheduler.step()  # the prefill of all of them
        _timed_steps(engine, clock, ForwardMode.DECODE, WARMUP_STEPS)
        timed = _timed_steps(engine, clock, ForwardMode.DECODE, TIMED_STEPS)
        emit(_row(base, f"decode-batch-{batch}", *timed), args.out)
        while engine.scheduler.has_work():
            engine.scheduler.step()


def _row(base: dict, step: str, step_s: float, collective_s: float, calls: int) -> dict:
    return {**base, "step": step, "step_ms": round(step_s * 1e3, 2),
            "collectives_ms": round(collective_s * 1e3, 2), "collective_calls": calls}  # fmt: skip


ALL_REDUCE_ROWS = (1, 16, 256)
ALL_REDUCE_REPEATS = 400


def _all_reduce_rank(rank: int, port: int, hidden: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from gpu_worker.parallel.group import join_group, leave_group
    from gpu_worker.parallel.shard import TPShard

    torch.set_num_threads(1)
    group = join_group(TPShard(rank, 2), f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    ways = {"gloo": lambda t: dist.all_reduce(t, group=group.device_group)}
    if group.shared is not None:
        ways["shared-memory"] = group.shared.all_reduce
    for way, all_reduce in ways.items():
        for rows in ALL_REDUCE_ROWS:
            tensor = torch.ones(rows, hidden)
            for _ in range(20):
                all_reduce(tensor)
            started = time.perf_counter()
            for _ in range(ALL_REDUCE_REPEATS):
                all_reduce(tensor)
            if rank == 0:
                queue.put((way, rows, (time.perf_counter() - started) / ALL_REDUCE_REPEATS))
    leave_group()
    if rank == 0:
        queue.put(None)  # the last result


def measure_all_reduce(args, hidden: int) -> None:
    import multiprocessing
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=_all_reduce_rank, args=(r, port, hidden, queue))
             for r in (0, 1)]  # fmt: skip
    for process in ranks:
        process.start()
    while (result := queue.get(timeout=120)) is not None:
        way, rows, seconds = result
        emit({"step": f"all-reduce-{rows}x{hidden}-float32", "via": way,
              "us": round(seconds * 1e6, 1), "machine": machine()}, args.out)  # fmt: skip
    for process in ranks:
        process.join()


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--tp", type=int, default=2, help="compared with tp 1")
    parser.add_argument("--batch", default="1,16", help="decode batch sizes")
    args = parse_engine_args(parser)
    clock = CollectiveClock()
    for batch in [int(b) for b in args.batch.split(",")]:
        for tp in (1, args.tp):
            measure(args, tp, batch, clock)
    from gpu_worker.models.loader import load_model_config

    measure_all_reduce(args, load_model_config(args.model).hidden_size)


if __name__ == "__main__":
    main()
