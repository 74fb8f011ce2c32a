"""A stage's or worker's writes of one step as one script call: all or nothing, one round trip.

Every stage commits a batch as one atomic unit (its outputs, dead letters and the
acknowledgement of its inputs), and a worker commits only while its fence still holds
(bus/fenced_stream.py). As MULTI/EXEC that costs two commands on top of the writes, and a
worker's fence two more round trips before them (WATCH, then GET; a WATCH alone misses a
change made before it). One EVALSHA of `COMMIT_SCRIPT` does the same in one command and one
round trip: the script checks the fence, then runs the queued commands in order; Redis runs a
script atomically, as it runs a MULTI. That is the bus's per-publish overhead, paid by every
publish of every stage: 4 of a worker's ~9 commands a publish, 2 of a detokenizer's 6.

Semantics kept from MULTI/EXEC: a command that fails (a key of the wrong type) leaves its
error in its slot and the others still run; a full Redis (OOM, which Redis refuses only before
a script's first write) refuses the whole call. The callers build their commands on a
non-transactional redis-py pipeline, as before, and this module sends what it queued.

The server must allow scripts (EVALSHA is in ACL category ``@scripting``, which the
README's ``+@all -@dangerous`` grants). Commands and their keys must hash to one slot on a
Redis Cluster, as a MULTI's must: every key of a shard carries its hash tag
(runtime/cluster.py).
"""

from __future__ import annotations

from typing import Any

import redis
from redis._parsers import helpers as _reply_parsers

from bus.effects import checked_replies

# ARGV[1] is the fence: "" none, "-" the fence key must be absent, "=" .. value it must
# hold. Then each command as its argument count and its arguments. Returns false (nil) when
# the fence moved, having written nothing; else one reply (or error) per command.
COMMIT_SCRIPT = """
local fence = ARGV[1]
if fence ~= '' then
  local held = redis.call('GET', KEYS[1])
  if fence == '-' then
    if held then return false end
  elseif held ~= string.sub(fence, 2) then
    return false
  end
end
local replies, i = {}, 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local ok, reply = pcall(redis.call, unpack(ARGV, i + 1, i + n))
  if not ok then
    local message = type(reply) == 'table' and reply.err or tostring(reply)
    if string.sub(message, 1, 3) == 'OOM' then return redis.error_reply(message) end
    reply = redis.error_reply(message)
  end
  replies[#replies + 1] = reply
  i = i + n + 1
end
return replies
"""

NO_FENCE = ""
# A script's replies reach the client as RESP2 shapes whatever protocol the connection speaks
# (redis.call answers a script in RESP2), so they are parsed by redis-py's RESP2 callbacks.
# Those give the shapes a RESP3 connection gives callers too (its legacy conversion).
_RESP2_CALLBACKS = {**_reply_parsers._RedisCallbacks, **_reply_parsers._RedisCallbacksRESP2}
# Lua's unpack takes a few thousand values at most; a command longer than this (an XACK of
# thousands of ids) goes by MULTI/EXEC instead.
MAX_SCRIPT_ARGS = 4000


class FenceMoved(Exception):  # noqa: N818 (a state the caller recovers from)
    """The fence key no longer held the value the commit was made under: nothing written."""


def fence_arg(value: bytes | None) -> bytes:
    """The script's fence argument for a fence key that must hold `value` (None: absent)."""
    return b"-" if value is None else b"=" + value


class ScriptedCommit:
    """Sends the commands queued on a redis-py pipeline as one `COMMIT_SCRIPT` call."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._script = client.register_script(COMMIT_SCRIPT)

    def execute(
        self, pipe: Any, who: str, *, key: str, fence: bytes = NO_FENCE.encode()
    ) -> list[Any]:
        """Run `pipe`'s queued commands atomically and return their replies, parsed as the
        pipeline would (a failed command's ResponseError in its slot, logged). `key` is one
        key of the commit's slot (the fence key, when there is a fence). Raises FenceMoved,
        or redis.OutOfMemoryError when Redis refused the whole commit."""
        commands = [(args, options) for args, options in pipe.command_stack]
        pipe.reset()
        if any(len(args) > MAX_SCRIPT_ARGS for args, _ in commands):
            return self._by_multi(commands, who, key, fence)
        argv: list[Any] = [fence]
        for args, _ in commands:
            argv += [len(args), *args]
        replies = self._script(keys=[key], args=argv, client=self.client)
        if replies is None:
            raise FenceMoved(key)
        return _parsed(commands, replies, who)

    def _by_multi(self, commands: list, who: str, key: str, fence: bytes) -> list[Any]:
        with self.client.pipeline(transaction=True) as pipe:
            try:
                if fence:
                    pipe.watch(key)
                    held = pipe.get(key)
                    if held is not None if fence == b"-" else held != fence[1:]:
                        raise FenceMoved(key)
                    pipe.multi()
                for args, options in commands:
                    pipe.execute_command(*args, **options)
                replies = pipe.execute(raise_on_error=False)
            except redis.WatchError as exc:
                raise FenceMoved(key) from exc
        return checked_replies(replies, who)


def _parsed(commands: list, replies: list[Any], who: str) -> list[Any]:
    """The script's raw replies through each command's response callback, as a pipeline's."""
    out = []
    for reply, (args, options) in zip(replies, commands, strict=True):
        if not isinstance(reply, Exception):
            options = {k: v for k, v in options.items() if k != "keys"}
            callback = _RESP2_CALLBACKS.get(args[0])
            if callback is not None:
                reply = callback(reply, **options)
        out.append(reply)
    return checked_replies(out, who)
