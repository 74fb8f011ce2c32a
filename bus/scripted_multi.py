"""A worker's fenced commit run by one Lua script instead of WATCH, GET, MULTI ... EXEC: the
same all-or-nothing write, one round trip and two commands fewer.

A worker's publish (bus/fenced_stream.py) writes its token batch, its progress-log entry and
the acknowledgements of finished jobs only while its fence key still holds the token it
took: as a MULTI that was a WATCH and a GET of the fence (one round trip), then MULTI, the
writes and EXEC (a second). `ScriptedMulti` records the same commands, driven through
redis-py's command methods (``xadd``, ``xack``, ...), and `execute` sends them in one EVALSHA
of `SOURCE`, which

- checks the fence first (the key must hold the token the caller's writes are valid under,
  or not exist if it held none) and writes nothing otherwise, raising ``redis.WatchError``
  as a failed WATCH would;
- runs each command under ``redis.pcall``: one that fails (an output to a key of the wrong
  type) is returned as its error and the others still run, as the commands of a MULTI do
  (`bus.effects.execute_logging_errors` logs and drops it);
- is declared with a shebang, so a server over ``maxmemory`` refuses it whole (OOM), as it
  refuses a MULTI, rather than run its first writes.

A script is atomic as a MULTI is: nothing else runs between its commands, and a client that
dies while sending it has sent nothing. On a Redis Cluster every name of one shard hashes to
one slot (runtime/config.py ``prefix``): the script declares the fence key (or the first key
its commands name), so a node that does not own that slot answers MOVED; declaring each key
would send every name twice. Redis 7 is required (shebang scripts), as the README says.

Only the fenced commit is a script. Server CPU per commit on the embedded valkey 9.1
(`python benchmarks/bench_commit_cost.py`, the median of alternating rounds): a worker's
publish 76.0 µs as WATCH/GET then MULTI/EXEC, 44.6 as a script; a detokenizer's hand-off
(XADD, XACK) 27.8 µs as MULTI/EXEC, 39.2 as a script: with no round trip to save, the
interpreter's cost per call outweighs the two commands it saves. Redis CPU is what a shard
runs out of, so the stages' plain hand-offs stay MULTIs (bus/actor.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis
from redis.commands.core import BasicKeyCommands, HashCommands, StreamCommands

SOURCE = """#!lua
-- ARGV[1]: the fence: '' none; '!' KEYS[1] must not exist; '=' .. token KEYS[1] must hold.
-- Then each command as its argument count and its arguments.
local fence = ARGV[1]
if fence ~= '' then
  local held = redis.call('GET', KEYS[1])
  if fence == '!' then
    if held then return redis.error_reply('FENCED') end
  elseif held ~= string.sub(fence, 2) then
    return redis.error_reply('FENCED')
  end
end
local results = {}
local i, n = 2, #ARGV
while i <= n do
  local argc = tonumber(ARGV[i])
  results[#results + 1] = redis.pcall(unpack(ARGV, i + 1, i + argc))
  i = i + argc + 1
end
return results
"""
SHA = hashlib.sha1(SOURCE.encode()).hexdigest()
FENCED = "FENCED"


class ScriptedMulti(StreamCommands, BasicKeyCommands, HashCommands):
    """The commands of one commit, sent by `execute` as one script call. Used as a
    transaction pipeline is: queue commands through its methods, then execute."""

    def __init__(self, client: redis.Redis, fence: tuple[str, bytes | None] | None = None):
        self.client = client
        self.fence = fence  # (fence key, the token it must hold; None: it must not exist)
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> ScriptedMulti:
        self.commands.append(args)
        return self

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """Per command, what a pipeline would have returned for it (stream reads as redis-py
        parses them; errors as ResponseError instances, or the first one raised as a
        pipeline's `execute` raises it). Raises ``redis.WatchError`` when fenced."""
        if not self.commands and self.fence is None:
            return []
        keys, args = self._script_call()
        try:
            try:
                raw = self.client.evalsha(SHA, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:  # a new or restarted server
                self.client.script_load(SOURCE)
                raw = self.client.evalsha(SHA, len(keys), *keys, *args)
        except redis.ResponseError as exc:
            raise _fenced_or(exc) from None
        pairs = zip(self.commands, raw, strict=True)
        results = [_parsed(command[0], result) for command, result in pairs]
        if raise_on_error:
            for result in results:
                if isinstance(result, Exception):
                    raise result
        return results

    def _script_call(self) -> tuple[list[Any], list[Any]]:
        """(keys, args) of the EVALSHA."""
        if self.fence is not None:
            key, token = self.fence
            keys = [key]
            args: list[Any] = ["!" if token is None else b"=" + token]
        else:
            keys = [_first_key(self.commands[0])]
            args = [""]
        for command in self.commands:
            args.append(len(command))
            args.extend(command)
        return keys, args


def _fenced_or(exc: redis.ResponseError) -> redis.RedisError:
    if str(exc) == FENCED:
        return redis.WatchError("fenced: the fence key changed since this writer took it")
    return exc


def _first_key(command: tuple[Any, ...]) -> Any:
    """The first key a command names: its first argument, or XREAD(GROUP)'s after STREAMS."""
    if _upper(command[0]) in ("XREADGROUP", "XREAD"):
        return command[list(map(_upper, command)).index("STREAMS") + 1]
    return command[1]


def _upper(arg: Any) -> str:
    if isinstance(arg, bytes):
        return arg.decode(errors="replace").upper()
    return arg.upper() if isinstance(arg, str) else ""


def _parsed(name: Any, result: Any) -> Any:
    if isinstance(result, Exception) or result is None:
        return result
    if _upper(name) in ("XREADGROUP", "XREAD"):
        # As redis-py's RESP2 parse: [[stream, [(id, {field: value}), ...]], ...]; a
        # deleted entry's fields are None.
        return [
            [stream, [(entry_id, _pairs(fields)) for entry_id, fields in entries]]
            for stream, entries in result
        ]
    return result


def _pairs(fields: list[bytes] | None) -> dict[bytes, bytes] | None:
    if fields is None:
        return None
    return dict(zip(fields[::2], fields[1::2], strict=True))
