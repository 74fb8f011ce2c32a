"""A worker's fenced commit run by one Lua script instead of WATCH, GET, MULTI ... EXEC: the
same all-or-nothing write, one round trip, and no command spent on the fence.

A worker's publish (bus/fenced_stream.py) writes its token batch, its progress-log entry and
the acknowledgements of finished jobs only while no reaper has taken jobs off it: as a MULTI
that was a WATCH and a GET of a fence key (one round trip), then MULTI, the writes and EXEC
(a second). `ScriptedMulti` records the same commands, driven through redis-py's command
methods (``xadd``, ``xack``, ...), and `execute` sends them in one EVALSHA of `SOURCE`, which

- with ``guarded``, takes the first command as the fence: its own write, which the reaper
  makes fail (the worker's progress-log XADD, which a closed or deleted log refuses:
  fenced_stream.py). If it fails or writes nothing, nothing else runs and the call raises
  ``redis.WatchError`` as a failed WATCH would. So the fence costs no command of its own:
  a GET of a fence key had been one command per publish (Redis counts the commands a
  script runs, issue 27);
- runs each other command under ``redis.pcall``: one that fails (an output to a key of the
  wrong type) is returned as its error and the others still run, as the commands of a MULTI
  do (`bus.effects.execute_logging_errors` logs and drops it);
- is declared with a shebang, so a server over ``maxmemory`` refuses it whole (OOM), as it
  refuses a MULTI, rather than run its first writes.

A script is atomic as a MULTI is: nothing else runs between its commands, and a client that
dies while sending it has sent nothing. On a Redis Cluster every name of one shard hashes to
one slot (runtime/config.py ``prefix``): the script declares the first key its commands name,
so a node that does not own that slot answers MOVED; declaring each key would send every
name twice. Redis 7 is required (shebang scripts), as the README says.

Of the hand-offs between stages, only the fenced commit is a script. Server CPU per commit
on the embedded valkey 9.1 (`python benchmarks/bench_commit_cost.py`, the median of
alternating rounds): a worker's publish 76.0 µs as WATCH/GET then MULTI/EXEC, 44.6 as a
script (then with its GET); a detokenizer's hand-off (XADD, XACK) 27.8 µs as MULTI/EXEC,
39.2 as a script: with no round trip to save, the interpreter's cost per call outweighs the
two commands it saves. Redis CPU is what a shard runs out of, so the stages' plain hand-offs
stay MULTIs (bus/actor.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis
from redis.commands.core import BasicKeyCommands, HashCommands, StreamCommands

SOURCE = """#!lua
-- ARGV[1]: '1' the first command is the fence (it must write, else nothing runs), '' none.
-- Then each command as its argument count and its arguments.
local guarded = ARGV[1] == '1'
local results = {}
local i, n = 2, #ARGV
while i <= n do
  local argc = tonumber(ARGV[i])
  local result = redis.pcall(unpack(ARGV, i + 1, i + argc))
  if guarded then  -- an error, or nil (NOMKSTREAM on a missing stream): fenced
    if type(result) ~= 'string' then return redis.error_reply('FENCED') end
    guarded = false
  end
  results[#results + 1] = result
  i = i + argc + 1
end
return results
"""
SHA = hashlib.sha1(SOURCE.encode()).hexdigest()
FENCED = "FENCED"


class ScriptedMulti(StreamCommands, BasicKeyCommands, HashCommands):
    """The commands of one commit, sent by `execute` as one script call. Used as a
    transaction pipeline is: queue commands through its methods, then execute."""

    def __init__(self, client: redis.Redis, guarded: bool = False):
        self.client = client
        self.guarded = guarded  # the first command is the fence: it must write
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> ScriptedMulti:
        self.commands.append(args)
        return self

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """Per command, what a pipeline would have returned for it (stream reads as redis-py
        parses them; errors as ResponseError instances, or the first one raised as a
        pipeline's `execute` raises it). Raises ``redis.WatchError`` when fenced: the
        first command of a guarded call failed or wrote nothing, and nothing ran."""
        if not self.commands:
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
        keys = [_first_key(self.commands[0])]
        args: list[Any] = ["1" if self.guarded else ""]
        for command in self.commands:
            args.append(len(command))
            args.extend(command)
        return keys, args


def _fenced_or(exc: redis.ResponseError) -> redis.RedisError:
    if str(exc) == FENCED:
        return redis.WatchError("fenced: a reaper took jobs off this writer since it opened")
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
