"""Reply streams: deltas put back in output order, copies dropped, errors terminal; the
asyncio and blocking readers on the real Redis."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis.asyncio as aredis

from bus.replies import AsyncReplyReader, ReplyReader
from bus.reply_order import ReplyOrderer
from bus.reply_router import ReplyRouter
from jobs.protocol import ENTRY_FIELD, ErrorReply, Finish, TextDelta, encode

FINISH = Finish("stop", None, 3, 4).to_wire()


def delta(seq: int, ids: list[int], finish=None, rid: str = "r") -> TextDelta:
    return TextDelta(rid, seq, ids, "".join(chr(97 + i) for i in ids), finish)


def released_seqs(orderer: ReplyOrderer, messages) -> list[int]:
    return [m.seq for message in messages for m in orderer.push(message)]


def test_deltas_out_of_order_are_released_in_output_order():
    orderer = ReplyOrderer()
    order = [delta(3, [3], FINISH), delta(1, [1, 2]), delta(0, [0])]
    assert released_seqs(orderer, order) == [0, 1, 3]
    assert orderer.done


def test_copies_are_dropped_before_and_after_release():
    orderer = ReplyOrderer()
    order = [delta(1, [1]), delta(1, [1]), delta(0, [0]), delta(0, [0]), delta(1, [1]),
             delta(2, [2], FINISH), delta(2, [2], FINISH)]  # fmt: skip
    assert released_seqs(orderer, order) == [0, 1, 2]


def test_a_finish_without_ids_waits_for_the_tokens_before_it():
    orderer = ReplyOrderer()
    assert orderer.push(TextDelta("r", 2, [], None, FINISH)) == []
    assert not orderer.done
    assert released_seqs(orderer, [delta(1, [1]), delta(0, [0])]) == [0, 1, 2]
    assert orderer.done


def test_an_error_is_terminal_at_once_and_later_deltas_are_ignored():
    orderer = ReplyOrderer()
    assert orderer.push(delta(1, [1])) == []
    error = ErrorReply("r", 500, "worker died", "internal_error")
    assert orderer.push(error) == [error]
    assert orderer.done
    assert orderer.push(delta(0, [0])) == []


def xadd(client, stream: str, *messages) -> None:
    for message in messages:
        client.xadd(stream, {ENTRY_FIELD: encode(message)})


def test_async_reader_orders_each_rid_and_ignores_unknown_ones(redis_client, redis_url):
    stream = "test:reply:a"
    # Written before the reader starts: a reader starting at `$` would lose them.
    xadd(redis_client, stream, delta(1, [1], rid="a"), delta(0, [5], rid="b"),
         delta(0, [9], rid="stranger"))  # fmt: skip
    redis_client.xadd(stream, {ENTRY_FIELD: b"not msgpack"})

    async def main():
        client = aredis.Redis.from_url(redis_url)
        reader = AsyncReplyReader(client, stream)
        queue = reader.register("a")
        reader.register("b", queue)  # one queue may serve several rids
        reader.start()
        xadd(redis_client, stream, delta(0, [0], rid="a"), delta(2, [2], FINISH, rid="a"),
             delta(1, [6], FINISH, rid="b"), delta(2, [2], FINISH, rid="a"))  # fmt: skip
        got = [await asyncio.wait_for(queue.get(), 2) for _ in range(5)]
        await asyncio.sleep(0.05)
        assert queue.empty()  # the late copy of a's finish went nowhere
        await reader.close()
        await client.aclose()
        return [(m.rid, m.seq) for m in got]

    got = asyncio.run(main())
    assert [x for x in got if x[0] == "a"] == [("a", 0), ("a", 1), ("a", 2)]
    assert [x for x in got if x[0] == "b"] == [("b", 0), ("b", 1)]
    assert not redis_client.exists(stream)  # deleted on close


def test_async_reader_fails_waiting_requests_when_redis_is_unreachable(tmp_path):
    async def main():
        client = aredis.Redis.from_url(f"unix://{tmp_path}/none.sock")
        reader = AsyncReplyReader(client, "test:reply:x")
        queue = reader.register("r")
        reader.start()
        reply = await asyncio.wait_for(queue.get(), 2)
        await reader.close(delete_stream=False)
        await client.aclose()
        return reply

    reply = asyncio.run(main())
    assert isinstance(reply, ErrorReply) and reply.status == 503


def test_sync_reader_serves_threads_waiting_on_different_rids(redis_client):
    stream = "test:reply:s"
    reader = ReplyReader(redis_client, stream, block_ms=50)
    rids = [f"r{i}" for i in range(4)]
    for rid in rids:
        reader.register(rid)
    got: dict[str, list[int]] = {}

    def wait(rid: str) -> None:
        seqs = []
        while True:
            message = reader.get(rid, timeout=2)
            seqs.append(message.seq)
            if message.finish is not None:
                break
        got[rid] = seqs

    threads = [threading.Thread(target=wait, args=(rid,)) for rid in rids]
    for thread in threads:
        thread.start()
    for rid in rids:
        xadd(redis_client, stream, delta(1, [1], FINISH, rid=rid), delta(0, [0], rid=rid))
    for thread in threads:
        thread.join(timeout=3)
    assert got == {rid: [0, 1] for rid in rids}
    reader.close()
    assert not redis_client.exists(stream)


def test_sync_reader_times_out_and_cancel_ends_the_wait(redis_client):
    reader = ReplyReader(redis_client, "test:reply:t", block_ms=50)
    reader.register("r")
    with pytest.raises(TimeoutError):
        reader.get("r", timeout=0.1)
    reader.cancel("r")
    assert reader.get("r", timeout=1) is None
    with pytest.raises(KeyError):
        reader.get("r", timeout=0.1)


def test_the_trim_point_keeps_the_history_of_requests_still_running():
    """A replica that resumes a dead one's stream replays each running request from its
    first reply: trimming must not have removed it."""
    router = ReplyRouter("s")
    router.register("long")
    router.register("short")

    def entry(entry_id: bytes, delta: TextDelta):
        return entry_id, {ENTRY_FIELD: encode(delta)}

    router.route([entry(b"5-0", TextDelta("long", 0, [1], "a"))])
    router.route([entry(b"9-0", TextDelta("short", 0, [1], "b", finish=FINISH))])
    router.route([entry(b"12-0", TextDelta("long", 1, [2], "c"))])
    assert router.trim_point() == b"5-0"  # "long" runs on: its first reply stays
    router.route([entry(b"14-0", TextDelta("long", 2, [], "", finish=FINISH))])
    router._next_trim = 0.0
    assert router.trim_point() == b"14-0"  # nothing runs: everything read can go
