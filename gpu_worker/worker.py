"""The worker stage: the engine loop with the bus around it.

    python -m gpu_worker.worker --redis-url unix:///tmp/redis.sock --model smollm2-135m-instruct

The loop is the engine's (receive, schedule, forward, sample, process results) with Redis
at its two ends. Jobs arrive on this worker's own stream ``<p>:worker:<id>``, where the
router stage routes them; every step publishes one TokenBatch with every request's new
tokens to ``<p>:tokens``. While there is work, one MULTI per step carries the step's
tokens, the acknowledgements of jobs admitted and a non-blocking read of new jobs, so the
bus costs one round trip per step; idle, the worker blocks on its stream. The heartbeat
has a thread of its own (gpu_worker/heartbeat.py), so a long step never makes a live
worker look dead. Forming batches stays here: a round trip to Redis per decode step is all
the bus may cost.

The worker does not detokenize: requests with stop strings keep a TextStream to find them,
the rest leave text to the detokenizer stage. Each item carries the token window the
detokenizer needs (stages/detokenizer/incremental.py).

Nothing is lost when a worker dies. A job stays pending on the worker's stream until it
finishes (its acknowledgement goes in the MULTI with its last tokens), and each request's
published tokens are appended to its progress key in the MULTI that publishes them. When
the heartbeat lapses, the router's reaper (stages/router/worker_reaper.py) moves the pending
jobs to the router again, and the worker that gets one continues after its progress: no
token is repeated or missing. A worker stopped with SIGTERM finishes its step, publishes it,
and leaves its jobs to the reaper the same way.

A worker taken for dead while alive (paused, or out of reach of Redis for longer than the
heartbeat TTL) must not go on publishing for jobs now served elsewhere: two writers would
send a client two versions of a token and garble the progress key. Every write is a MULTI
under WATCH of the worker's fence key, which the reaper changes in the MULTI that claims
jobs off it. A worker whose fence changed drops every job and starts again from its
stream: the entries still pending to it are its own, and resume from their progress.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from bus.access import check_access
from bus.actor import (
    RECONNECT_BACKOFF_S,
    AppendKey,
    DeleteKey,
    Outbound,
    Output,
    dead_letter_fields,
    ensure_group,
    execute_logging_errors,
    is_missing_group,
    reply,
    stop_on_signals,
    unique_consumer_name,
    write_outputs,
)
from bus.config import BusConfig
from bus.field_error import FieldError
from bus.protocol import (
    ENTRY_FIELD,
    Abort,
    ErrorReply,
    Finish,
    ProtocolError,
    TokenBatch,
    TokenItem,
    TokenizedRequest,
    decode,
    pack_ids,
    token_context,
    unpack_ids,
)
from bus.sampling_params import SamplingParams
from bus.stop_strings import stop_window_tokens
from gpu_worker.engine import Engine
from gpu_worker.heartbeat import HeartbeatThread, Load
from gpu_worker.scheduling.req import Req

logger = logging.getLogger(__name__)

GROUP = "worker"
# Output tokens of context per item beyond the longest stop string: covers a character
# split over up to 4 byte tokens, and a window start that decodes differently.
CONTEXT_TOKENS = 8


@dataclass
class RunningJob:
    req: Req
    reply_to: str
    entry_id: bytes  # acknowledged when the request finishes, not before
    window: int  # output tokens of context the detokenizer needs
    reported: int = 0  # output tokens already published
    progress_ttl_set: bool = False


class Worker:
    def __init__(
        self, engine: Engine, client: redis.Redis, config: BusConfig, worker_id: str, model: str
    ) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.client = client
        self.config = config
        self.worker_id = worker_id
        self.model = model
        self.stream = config.worker_stream(worker_id)
        self.consumer = unique_consumer_name(f"worker-{worker_id}")
        self.stop = threading.Event()
        self.jobs: dict[str, RunningJob] = {}
        self.admitted = 0
        self.steps = 0
        self.bus_seconds = 0.0  # time spent on Redis while there was work: the bus's cost
        self._outbox: list[Output] = []
        self._acks: list[bytes] = []
        self._dead: list[dict[str, Any]] = []
        self.fence_key = config.fence_key(worker_id)
        self._fence: bytes | None = None  # the fence token our writes are valid under
        self.heartbeat = HeartbeatThread(
            client, config, worker_id, self.stream, model, engine.runner.max_total_tokens,
            attention=engine.runner.serving_path(),
        )  # fmt: skip

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> None:
        ensure_group(self.client, self.stream, GROUP)
        # `admitted` counts from 0 again: so must the jobs routed to this id, or a restarted
        # worker would look busy with its previous life's jobs.
        self.client.hdel(self.config.routed_key(), self.worker_id)
        self._fence = self.client.get(self.fence_key)
        # Jobs a previous life under this id left pending: resumed here, from their progress.
        entries = self._claim_pending()
        self._report_load()
        self.heartbeat.beat()  # the routers can route to us now
        self.heartbeat.start()
        logger.info("worker %s: consumer %s on %s, %s in %s on %s", self.worker_id,
                    self.consumer, self.stream, self.engine.config.model,
                    self.engine.runner.dtype, self.engine.runner.device)  # fmt: skip
        failures = 0
        try:
            while not self.stop.is_set():
                try:
                    if failures:  # back after an outage: a restarted Redis has no groups
                        ensure_group(self.client, self.stream, GROUP)
                    if entries:
                        self._admit(entries)
                        entries = []
                    if self.scheduler.has_work():
                        self._step()
                        started = time.perf_counter()
                        entries = self._commit(read=True)
                        self.bus_seconds += time.perf_counter() - started
                    else:
                        self._commit(read=False)
                        entries = self._read_blocking()
                    failures = 0
                    self._report_load()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    # Outputs not yet written stay in the outbox for the next commit.
                    delay = RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
                    failures += 1
                    logger.warning("worker %s: Redis unreachable (%s); retrying in %.1f s",
                                   self.worker_id, exc, delay)  # fmt: skip
                    self.stop.wait(delay)
                    self._report_load()
                except redis.ResponseError as exc:
                    if not is_missing_group(exc):
                        raise
                    logger.warning("worker %s: consumer group gone (Redis restarted?); "
                                   "recreating it", self.worker_id)  # fmt: skip
                    ensure_group(self.client, self.stream, GROUP)
        finally:
            self._shutdown()

    def _claim_pending(self) -> list[Any]:
        entries, cursor = [], "0-0"
        while True:
            cursor, claimed, _ = self.client.xautoclaim(
                self.stream, GROUP, self.consumer, min_idle_time=0, start_id=cursor, count=1000
            )
            entries += claimed
            if cursor in (b"0-0", "0-0") or not claimed:
                return entries

    def _read_blocking(self) -> list[Any]:
        response = self.client.xreadgroup(
            GROUP, self.consumer, {self.stream: ">"},
            count=self.config.read_count, block=self.config.block_ms,
        )  # fmt: skip
        return response[0][1] if response else []

    def _commit(self, read: bool) -> list[Any]:
        """One MULTI, valid only under our fence: outputs, acks, dead letters, and
        (optionally) a non-blocking read of new jobs. Returns the jobs read."""
        if not (self._outbox or self._acks or self._dead or read):
            return []
        with self.client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.fence_key)
                if pipe.get(self.fence_key) != self._fence:
                    raise redis.WatchError("fenced before this write")
                pipe.multi()
                write_outputs(pipe, self.config, self._outbox)
                for fields in self._dead:
                    pipe.xadd(self.config.dead_letter_stream(), fields,
                              maxlen=self.config.stream_maxlen, approximate=True)  # fmt: skip
                if self._acks:
                    pipe.xack(self.stream, GROUP, *self._acks)
                if read:
                    pipe.xreadgroup(GROUP, self.consumer, {self.stream: ">"},
                                    count=self.config.read_count)  # fmt: skip
                results = execute_logging_errors(pipe, f"worker {self.worker_id}")
            except redis.WatchError:
                return self._restart_fenced()
        self._outbox, self._acks, self._dead = [], [], []
        if read and results[-1] and not isinstance(results[-1], redis.ResponseError):
            return results[-1][0][1]
        return []

    def _restart_fenced(self) -> list[Any]:
        """The reaper took jobs off us. Drop every job and what was not yet written of them,
        and return the entries still pending to us: those are ours, to admit again, each
        resuming after its progress."""
        logger.warning("worker %s: taken for dead, jobs were claimed off it; dropping %d "
                       "jobs and resuming those still its own", self.worker_id,
                       len(self.jobs))  # fmt: skip
        for rid in list(self.jobs):
            self.scheduler.abort_request(rid)
        self.jobs.clear()
        self._outbox, self._acks, self._dead = [], [], []
        self._fence = self.client.get(self.fence_key)
        ensure_group(self.client, self.stream, GROUP)  # the reaper may have deleted it
        ids = [
            pending["message_id"]
            for pending in self.client.xpending_range(
                self.stream, GROUP, "-", "+", count=10_000, consumername=self.consumer
            )
        ]
        pipe = self.client.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(self.stream, entry_id, entry_id)
        return [entry for found in pipe.execute() for entry in found]

    def _report_load(self) -> None:
        load = self.scheduler.load()
        self.heartbeat.report(
            Load(load["running"], load["waiting"], load["free_kv_tokens"], self.admitted)
        )

    # ---- jobs in -------------------------------------------------------------------------

    def _admit(self, entries: list[Any]) -> None:
        jobs: list[tuple[bytes, TokenizedRequest]] = []
        for entry_id, fields in entries:
            if fields is None:
                self._acks.append(entry_id)
                continue
            payload = fields.get(ENTRY_FIELD)
            try:
                message = decode(payload, TokenizedRequest, Abort)
            except ProtocolError as exc:
                self._acks.append(entry_id)
                self._dead.append(dead_letter_fields(self.stream, entry_id, str(exc), payload))
                continue
            if isinstance(message, Abort):
                self._acks.append(entry_id)
                self._abort(message.rid)
            else:
                jobs.append((entry_id, message))
        self.admitted += len(jobs)
        if not jobs:
            return
        # A job aborted while on its way here is dropped on arrival (see bus/aborts.py); one
        # with progress was begun by a worker that died, and continues after it.
        pipe = self.client.pipeline(transaction=False)
        pipe.mget([self.config.abort_key(job.rid) for _, job in jobs])
        pipe.mget([self.config.progress_key(job.rid) for _, job in jobs])
        aborted, progress = pipe.execute()
        for (entry_id, job), abort_flag, done in zip(jobs, aborted, progress, strict=True):
            if abort_flag is not None:
                self._acks.append(entry_id)
                self._publish_items([self._aborted_on_arrival(job, done)])
            else:
                self._start(entry_id, job, done)

    def _aborted_on_arrival(self, job: TokenizedRequest, progress: bytes | None) -> TokenItem:
        """The last item of a job aborted on its way here: its stream ends with "abort"
        (whoever aborted it may still be reading: POST /v1/abort, Client.abort)."""
        generated = len(unpack_ids(progress)) if progress else 0
        if progress:
            self._outbox.append(DeleteKey(self.config.progress_key(job.rid)))
        finish = Finish("abort", None, len(job.input_ids), generated)
        return TokenItem(job.rid, job.reply_to, generated, [], [], 0, finish=finish)

    def _start(self, entry_id: bytes, job: TokenizedRequest, progress: bytes | None) -> None:
        if job.rid in self.jobs:
            logger.warning("worker %s: duplicate job %s ignored", self.worker_id, job.rid)
            self._acks.append(entry_id)
            return
        try:
            generated = unpack_ids(progress) if progress else []
            # OpenAI's missing max_tokens: as many as the context allows.
            budget = max(1, self.engine.token_budget(len(job.input_ids)))
            params = SamplingParams.from_wire(job.sampling, default_max_new_tokens=budget)
            req = self.engine.build_request(
                job.rid, job.input_ids, params, detokenize=False, output_ids=generated
            )
        except (ValueError, TypeError, ProtocolError) as exc:
            self._acks.append(entry_id)
            param, code = (exc.field, exc.code) if isinstance(exc, FieldError) else (None, None)
            self._outbox.append(reply(self.config, job.reply_to, ErrorReply(
                job.rid, 400, str(exc), "invalid_request_error", param, code)))  # fmt: skip
            return
        window = stop_window_tokens(params.stop, CONTEXT_TOKENS)
        running = RunningJob(req, job.reply_to, entry_id, window, reported=len(generated))
        self.jobs[job.rid] = running
        if generated:
            logger.info("worker %s: resuming %s after %d tokens", self.worker_id, job.rid,
                        len(generated))  # fmt: skip
        self.scheduler.add_request(req)

    def _abort(self, rid: str) -> None:
        req = self.scheduler.abort_request(rid)
        if req is not None and rid in self.jobs:
            self._publish_items([self._item(self.jobs[rid])])

    # ---- results out ---------------------------------------------------------------------

    def _step(self) -> None:
        sampled = self.scheduler.step()
        if sampled is None:
            # Admission checks that every request fits the pool alone; this is a bug.
            raise RuntimeError(f"scheduler has nothing to run: {self.scheduler.load()}")
        self.steps += 1
        items = [self._item(self.jobs[req.rid]) for req in sampled if req.rid in self.jobs]
        self._publish_items(items)

    def _publish_items(self, items: list[TokenItem]) -> None:
        if items:
            batch = TokenBatch(self.worker_id, self.steps, items)
            self._outbox.append(Outbound(self.config.tokens_stream(), batch))

    def _item(self, job: RunningJob) -> TokenItem:
        req = job.req
        start, end = job.reported, len(req.output_ids)
        job.reported = end
        if end > start and not req.finished:
            # Durable progress, written in the MULTI that publishes these tokens.
            ttl = None if job.progress_ttl_set else self.config.reply_ttl_s
            job.progress_ttl_set = True
            key = self.config.progress_key(req.rid)
            self._outbox.append(AppendKey(key, pack_ids(req.output_ids[start:end]), ttl))
        context, prompt_context = token_context(
            req.origin_input_ids, req.output_ids, start, job.window
        )
        item = TokenItem(
            req.rid, job.reply_to, start, req.output_ids[start:end], context, prompt_context,
            req.params.stop, req.params.skip_special_tokens,
        )  # fmt: skip
        if req.params.logprobs:
            item.logprobs = req.logprobs[start:end]
            if req.params.top_logprobs:
                item.top_logprobs = [
                    [[token, logprob] for token, logprob in top]
                    for top in req.top_logprobs[start:end]
                ]
        if req.finished:
            reason = req.finished_reason
            drafted = (req.draft.drafted, req.draft.accepted) if req.draft else (0, 0)
            item.finish = Finish(
                reason.kind, reason.matched, len(req.origin_input_ids), len(req.output_ids),
                req.prompt_cache_hit or 0, *drafted,
            )  # fmt: skip
            self._outbox.append(DeleteKey(self.config.progress_key(req.rid)))
            self._acks.append(job.entry_id)
            del self.jobs[req.rid]
        return item

    def _shutdown(self) -> None:
        """Publish what was generated and stop beating: the jobs still pending on our stream
        are the reaper's to move to live workers, which continue them after their progress."""
        for rid in list(self.jobs):
            self.scheduler.abort_request(rid)  # frees the KV; no finish is published
        self.jobs.clear()
        try:
            self._commit(read=False)
            self.heartbeat.goodbye()
        except redis.RedisError as exc:
            logger.warning("worker %s: could not say goodbye: %s", self.worker_id, exc)
        per_step_ms = 1000 * self.bus_seconds / max(self.steps, 1)
        logger.info("worker %s stopped after %d steps (%.3f ms of Redis per step)",
                    self.worker_id, self.steps, per_step_ms)  # fmt: skip


# ---- command line --------------------------------------------------------------------------


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{secrets.token_hex(3)}".replace(":", "-")


def _engine_option_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (forward_hooks as JSON), so the worker takes every
    engine option without a second list to keep in step."""
    import dataclasses
    import json

    from gpu_worker.config import EngineConfig

    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind == "bool":
            # --flag / --no-flag: a bool that defaults to True can be turned off too.
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif f.name == "forward_hooks":
            parser.add_argument(flag, type=json.loads, default=None, help="JSON list")
        else:
            convert = int if "int" in kind else float if "float" in kind else str
            parser.add_argument(flag, type=convert, default=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpu_worker.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--redis-url", default=None, help="default: $REDIS_URL")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--worker-id", default=None, help="default: <host>-<random>")
    parser.add_argument("--log-level", default="INFO")
    _engine_option_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    config = BusConfig.from_env(**({"redis_url": args.redis_url} if args.redis_url else {}))
    if config.redis_url is None:
        print("error: give --redis-url or set REDIS_URL", file=sys.stderr)
        return 2
    options = {
        key: value
        for key, value in vars(args).items()
        if value is not None and key not in ("redis_url", "model", "worker_id", "log_level")
    }
    client = redis.Redis.from_url(config.redis_url)
    try:
        check_access(client, config)  # before the model loads: a typo should fail fast
        engine = Engine(args.model, **options)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    worker = Worker(engine, client, config, args.worker_id or default_worker_id(), args.model)
    stop_on_signals(worker.stop)
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
