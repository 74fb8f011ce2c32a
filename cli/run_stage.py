"""Start one replica of a CPU stage against a Redis URL (what `streamserve stage` runs).

On a Redis Cluster a tokenizer, router or detokenizer attaches to one shard by itself
(runtime/cluster.py); if that shard's slots move while it runs, it exits with one line
saying so (`EXIT_SHARD_MOVED`), for its supervisor to start it again on the new layout."""

from __future__ import annotations

import logging
import threading

import redis

from bus.access import attach_checked, redacted
from bus.actor import Actor, stop_on_signals
from observability.metrics import start_publisher
from runtime.cluster import EXIT_SHARD_MOVED, is_slot_moved
from runtime.config import BusConfig
from runtime.gc_tuning import settle_heap

logger = logging.getLogger(__name__)

STAGES = ("ingress", "tokenizer", "router", "detokenizer")


def run_stage(
    name: str,
    config: BusConfig,
    *,
    model: str,
    host: str,
    port: int,
    max_body_bytes: int,
    max_queue: int,
) -> None:
    """Block until SIGTERM or SIGINT."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; the stages are {', '.join(STAGES)}")
    if config.redis_url is None:
        raise ValueError("a stage needs a Redis URL: give --redis-url or set REDIS_URL")
    config = attach_checked(config, name)
    if name == "ingress":
        from stages.ingress.server import run

        run(config, host=host, port=port, model=model, max_body_bytes=max_body_bytes,
            max_queue=max_queue)  # fmt: skip
        return
    client = redis.Redis.from_url(config.redis_url)
    stop = threading.Event()
    stop_on_signals(stop)
    if name == "router":
        from stages.router.stage import RouterStage
        from stages.router.worker_reaper import start_reaper_thread

        stage = RouterStage(config, client, stop)
    else:
        from jobs.model_tokenizer import load_model_tokenizer

        tokenizer = load_model_tokenizer(model)
        if name == "tokenizer":
            from runtime.context_length import model_context_length
            from stages.tokenizer.stage import TokenizerStage

            stage = TokenizerStage(config, tokenizer, model_context_length(model))
        else:
            from stages.detokenizer.stage import DetokenizerStage

            stage = DetokenizerStage(config, tokenizer)
    actor = Actor(client, config, stage, stop)
    stop_on_signals(stop, actor.interrupt_read)  # now with a read to end
    if name == "router":
        # Dead workers' jobs move on; the jobs it moves count in the router's metrics.
        start_reaper_thread(config, actor.consumer, stop, actor.metrics.process)
        stage.use_metrics(actor.metrics.process)
    publisher = start_publisher(client, config, actor.metrics.process)
    settle_heap()
    try:
        actor.run()
    except redis.ResponseError as exc:
        if not is_slot_moved(exc):
            raise
        logger.error("%s: shard %s moved off %s (%s); exiting to attach again", name,
                     config.shard, redacted(config.redis_url), exc)  # fmt: skip
        raise SystemExit(EXIT_SHARD_MOVED) from None
    finally:
        if publisher is not None:
            publisher.close()
    logger.info("%s stopped after %d entries", name, actor.processed)
