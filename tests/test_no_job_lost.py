"""No accepted job vanishes and nobody waits for ever: a flood past the old stream bound is
served whole, a request's keys outlive their TTL while it runs, and an HTTP request whose
job never answers gets a 504 (or an SSE error event) and its job aborted."""

from __future__ import annotations

import json
import threading
import time

from bus.actor import Actor
from bus.effects import Outbound
from jobs.protocol import ENTRY_FIELD, TokenizedRequest, decode
from runtime.config import BusConfig
from stages.router.stage import RouterStage
from tests.ingress_harness import MODEL, RunningIngress, Upstream, add_worker, deltas

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
FLOOD = 600  # jobs; the old bound below cut all but about the last hundred (a stream node)


def test_a_flood_past_the_stream_bound_loses_no_accepted_job(redis_client, redis_url):
    """Jobs XADDed while their consumer is stopped, far past STREAMSERVE_STREAM_MAXLEN: every
    one is routed once it runs, and the stream is trimmed only once they are acknowledged."""
    config = BusConfig(redis_url=redis_url, stream_maxlen=10, trim_interval_s=0.2, block_ms=20)
    add_worker(redis_client, config)
    rids = [f"flood-{i}" for i in range(FLOOD)]
    for start in range(0, FLOOD, 100):
        pipe = redis_client.pipeline(transaction=True)
        for rid in rids[start : start + 100]:  # an entry each (a commit would bundle them)
            Outbound(config.tokenized_stream(), TokenizedRequest(rid, "t:reply", [1], {})).apply(
                pipe, config
            )
        pipe.execute()
    assert redis_client.xlen(config.tokenized_stream()) == FLOOD

    stop = threading.Event()
    router = Actor(redis_client, config, RouterStage(config, redis_client, stop), stop)
    thread = threading.Thread(target=router.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while redis_client.xlen(config.worker_stream("w0")) < FLOOD:
            assert time.monotonic() < deadline, "not every job was routed"
            time.sleep(0.05)
        while redis_client.xlen(config.tokenized_stream()):  # all acknowledged: trimmed
            assert time.monotonic() < deadline, "acknowledged jobs were never trimmed"
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(timeout=5)
    routed = [
        decode(fields[ENTRY_FIELD], TokenizedRequest).rid
        for _, fields in redis_client.xrange(config.worker_stream("w0"))
    ]
    assert sorted(routed) == sorted(rids)
    assert redis_client.xlen(config.dead_letter_stream()) == 0


def _wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_request_keeps_its_keys_past_their_ttl_then_times_out_with_504_and_is_aborted(
    redis_client, redis_url
):
    """reply_ttl_s 2: its request key and the reply stream are renewed every half second;
    reply_timeout_s 4: with no reply by then, the handler answers 504 and aborts its job."""
    config = BusConfig(redis_url=redis_url, reply_ttl_s=2, reply_timeout_s=4.0)
    ingress = RunningIngress(redis_url)
    ingress.config = config
    answer: dict[str, object] = {}
    with ingress, Upstream(redis_url, config, lambda request: []) as upstream:
        add_worker(redis_client, config)
        reply_stream = config.reply_stream(ingress.state.frontend_id)
        redis_client.xadd(reply_stream, {"x": "y"})  # as a reply would: with the TTL
        redis_client.expire(reply_stream, config.reply_ttl_s)

        def post() -> None:
            answer["status"], answer["headers"], answer["data"] = ingress.request(
                "POST", CHAT, BODY
            )

        started = time.monotonic()
        waiting = threading.Thread(target=post)
        waiting.start()
        _wait_for(lambda: upstream.requests, 5, "the job was not submitted")
        request_id = upstream.requests[0].rid.rpartition("-")[0]
        time.sleep(3)  # past the 2 s TTL both were set with
        assert redis_client.exists(config.request_key(request_id))
        assert redis_client.exists(reply_stream)
        waiting.join(timeout=10)
        elapsed = time.monotonic() - started
        rid = upstream.requests[0].rid
        _wait_for(lambda: redis_client.exists(config.abort_key(rid)), 2, "the job not aborted")
        assert not redis_client.exists(config.request_key(request_id))
    error = json.loads(answer["data"])["error"]
    assert answer["status"] == 504 and error["code"] == "reply_timeout", answer
    assert 4 <= elapsed < 8


def test_a_stream_whose_job_never_answers_ends_with_an_sse_error_event(redis_client, redis_url):
    config = BusConfig(redis_url=redis_url, reply_timeout_s=1.0)
    ingress = RunningIngress(redis_url)
    ingress.config = config

    def first_token_only(request):
        first = deltas(request.rid, [("Hel", [1]), ("lo", [2])])[0]
        return [first]  # and then nothing, for ever

    with ingress, Upstream(redis_url, config, first_token_only):
        add_worker(redis_client, config)
        status, _, data = ingress.request("POST", CHAT, {**BODY, "stream": True})
    events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "reply_timeout"
