"""The wire codec under every message: one msgpack map per stream entry, checked field by field.

Every entry on every stream has a single field, ``m`` (`ENTRY_FIELD`), holding a msgpack map
whose ``kind`` names the message type. A `Message` subclass lists its fields' wire kinds;
`Message.from_wire` checks each (`check_field`) and `to_wire` packs them. Token ids travel
packed, never as lists of Python ints: as little-endian uint16s in a msgpack extension of type
`NARROW_IDS_EXT` where every id of the field fits in 16 bits (`pack_ids_narrow`), else as
little-endian int32 bytes (`pack_ids`); readers take either (`unpack_ids`). Prompt and output
ids were the bus's largest part per generated token (issue 27), and most vocabularies have
under 65,536 ids. A program's own jobs with int32 bytes (as the README shows) read as before,
and a plain TextDelta (a reply stream a program reads itself) is still written in int32.
Every mistake is a `ProtocolError` with the reason, which the stages write to the dead-letter
stream. The message kinds themselves are in jobs/protocol.py.

The bus's bulkiest entries (a worker's token batch and progress log entry, a detokenizer's
bundle of deltas: `Message.COMPRESSIBLE`) are written zlib-deflated once they pass
`COMPRESS_FROM_BYTES`: their field names, reply stream names and id prefixes repeat item
after item, and deflating at level 1 more than halves them (and what Redis stores, copies
and sends with them) for ~0.45 µs of the worker's CPU per token, which its readers about
win back on the thinner records (benchmarks/bench_wire_codec.py). A deflated payload starts
with zlib's header byte `DEFLATED_MARK`, which no msgpack map starts with, so readers tell
the two apart by it (`inflate`); only streams that take a compressible kind accept one, and
none is inflated past `MAX_INFLATED_BYTES`.

On the two job streams (the requests and the tokenized stream) a writer puts the jobs of one
commit in one entry: its single field ``jobs`` (`JOBS_FIELD`) holds a msgpack array of job
payloads, each exactly the bytes a single-job entry holds under ``m`` (`job_entries`; one
job alone is written as a plain single-job entry). Those streams were costing one XADD per
job per hop while their readers took a dozen entries a read (issue 27). Readers take both
forms apart with `job_payloads`; a bundle that is not a plain array of 1 to
`MAX_BUNDLE_JOBS` byte strings is refused whole, a bad job inside a good one on its own.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import math
import sys
import zlib
from typing import Any, ClassVar

import msgpack

ENTRY_FIELD = b"m"
# A worker's progress-log entry that also carries the token batch it published
# (bus/fenced_stream.py): its detokenizers read this field, and the entry's ``m`` is its
# progress.
TOKENS_FIELD = b"t"
# A job-stream entry holding several jobs (the module docstring says why).
JOBS_FIELD = b"jobs"
# Bounds on one bundle: a reader unpacks it whole, and Redis refuses a value past 512 MiB
# (a refused XADD would drop every job in it). A job larger than this still goes alone.
MAX_BUNDLE_JOBS = 4096
MAX_BUNDLE_BYTES = 8 * 2**20
# A token id is an int32 on the wire; vocabularies are far below this.
MAX_TOKEN_ID = 2**31 - 1
# zlib's first byte with deflate's default window: in msgpack, the positive fixint 120.
DEFLATED_MARK = b"\x78"
# Below this a payload is written as it is: deflating saves little and costs a call.
COMPRESS_FROM_BYTES = 1024
# Redis's own largest value (proto-max-bulk-len): what a plain entry could be at most.
MAX_INFLATED_BYTES = 512 * 2**20


class ProtocolError(ValueError):
    """An entry that is not a well-formed message of the kind expected; `field` names the
    field at fault where one is (its requester's 400 names it as ``param``)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


# Packed with the array module, not numpy: for the few ids of a token item it takes half
# the time (the bus packs and unpacks several per request per publish). "i" is a 4-byte C
# int wherever this runs; a big-endian host swaps to the wire's little-endian.
_SWAP = sys.byteorder == "big"
assert array.array("i").itemsize == 4


assert array.array("H").itemsize == 2
# The msgpack extension type of token ids packed as little-endian uint16 (`pack_ids_narrow`).
NARROW_IDS_EXT = 2


def pack_ids(ids: list[int] | tuple[int, ...]) -> bytes:
    packed = array.array("i", ids)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def pack_ids_narrow(ids: list[int] | tuple[int, ...]) -> bytes | msgpack.ExtType:
    """`ids` in half the bytes where every one fits in 16 bits (vocabularies up to 65,536
    ids, e.g. SmolLM2's, Llama 2's, Mistral's): a msgpack extension of type
    `NARROW_IDS_EXT` holding little-endian uint16s; else (or empty) `pack_ids`'s int32 bytes.
    An extension, not a flag inside the bytes: a reader that predates it refuses the field
    (a dead letter) where int32 bytes of the wrong length could decode to wrong ids."""
    if not ids:
        return b""
    try:
        packed = array.array("H", ids)
    except OverflowError:  # an id past 65,535 or below 0
        return pack_ids(ids)
    if _SWAP:
        packed.byteswap()
    # Made as the tuple it is: ExtType's own __new__ checks its arguments in Python, half
    # the cost of this call, and a worker packs two per request per publish.
    return tuple.__new__(msgpack.ExtType, (NARROW_IDS_EXT, packed.tobytes()))


def ext_type(code: int, data: bytes) -> msgpack.ExtType:
    """msgpack's `ext_hook` for the readers of messages: the ExtType its default makes, made
    as the tuple it is. The default calls ExtType's own __new__, whose checks in Python were
    half of unpacking a batch of deltas (30: 27 -> 19 us); msgpack gives an int and bytes."""
    return tuple.__new__(msgpack.ExtType, (code, data))


def unpack_ids(data: bytes | msgpack.ExtType) -> list[int]:
    """Token ids from either packing: int32 bytes or a narrow extension (`pack_ids_narrow`)."""
    if isinstance(data, msgpack.ExtType):
        if data.code != NARROW_IDS_EXT:
            raise ProtocolError(f"packed token ids: msgpack extension type {data.code} is not "
                                f"{NARROW_IDS_EXT} (uint16 ids)")  # fmt: skip
        data, ids, width = data.data, array.array("H"), 2
    else:
        ids, width = array.array("i"), 4
    if len(data) % width:
        raise ProtocolError(f"packed token ids: {len(data)} bytes is not a multiple of {width}")
    ids.frombytes(data)
    if _SWAP:
        ids.byteswap()
    return ids.tolist()


# ---- field checks ----------------------------------------------------------------------------
# Each message class lists its fields' wire kinds; `decode` checks them, `encode` packs them.

STR, INT, FLOAT, BOOL, MAP, LIST, IDS = "str", "int", "float", "bool", "map", "list", "ids"
BYTES = "bytes"  # raw bytes, kept as they are (an embedding's packed float32s)
# A record written by name (a map, version 2) or by position (a list, version 1).
RECORD = "map or list"


# Built once: check_field runs for every field of every entry a stage reads.
_TYPE_CHECKS = {
    STR: lambda v: isinstance(v, str),
    INT: lambda v: isinstance(v, int) and not isinstance(v, bool),
    FLOAT: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    BOOL: lambda v: isinstance(v, bool),
    MAP: lambda v: isinstance(v, dict),
    LIST: lambda v: isinstance(v, list),
    IDS: lambda v: isinstance(v, (bytes, msgpack.ExtType)),
    BYTES: lambda v: isinstance(v, bytes),
    RECORD: lambda v: isinstance(v, (dict, list)),
}


def check_field(kind: str, name: str, value: Any, optional: bool) -> Any:
    if value is None:
        if optional:
            return None
        raise ProtocolError(f"field {name!r} is missing")
    ok = _TYPE_CHECKS[kind](value)
    if not ok:
        raise ProtocolError(f"field {name!r} must be {kind}, got {type(value).__name__}")
    if kind == FLOAT:
        value = float(value)
        if not math.isfinite(value):
            raise ProtocolError(f"field {name!r} must be finite")
    if kind == IDS:
        value = unpack_ids(value)
    return value


# What this code writes: records by name (maps), version 2. Version 1 (no "v" field) is the
# positional lists of older workers, still read; a version above this one is refused.
WIRE_VERSION = 2


def check_version(what: str, version: Any) -> int:
    """The wire version a job, message or record says it is written in (absent: 1); a
    ProtocolError naming ``v`` for one this code does not read."""
    if version is None:
        return 1
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProtocolError(f"field 'v' must be int, got {type(version).__name__}", field="v")
    if not 1 <= version <= WIRE_VERSION:
        raise ProtocolError(
            f"{what} version {version} is not one this reader knows (1 to {WIRE_VERSION}): "
            f"write v={WIRE_VERSION}, or leave v out for version 1",
            field="v",
        )
    return version


@functools.cache
def _required(cls: type[Record]) -> tuple[str, ...]:
    """The fields a record of `cls` must have, in the order the class lists them."""
    return tuple(name for name in cls.FIELDS if name not in cls.OPTIONAL)


class Record:
    """Fields by name: ``FIELDS`` name -> wire kind, ``OPTIONAL`` those that may be absent.

    An absent optional field takes the dataclass's default; unknown names are ignored, so a
    later writer may add optional fields without breaking this reader."""

    FIELDS: ClassVar[dict[str, str]]
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, kind in self.FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if kind == IDS:
                value = pack_ids_narrow(value)
            elif kind == LIST and value and isinstance(value[0], Record):
                value = [item.to_wire() for item in value]
            out[name] = value
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any], defaults: dict[str, Any] | None = None) -> Record:
        """`defaults`: values, already checked, for fields the entry leaves to its container
        (a token batch's shared reply stream)."""
        # Over the fields the entry has, not all the class knows: most records leave most
        # optional fields off, and this runs for every token item a stage reads.
        fields = cls.FIELDS
        values = dict(defaults) if defaults else {}
        for name, value in data.items():
            kind = fields.get(name)
            if kind is not None and value is not None:
                values[name] = check_field(kind, name, value, False)
        for name in _required(cls):  # the first missing, in the order the class lists them
            if name not in values:
                raise ProtocolError(f"field {name!r} is missing")
        return cls(**values)


class Message(Record):
    """A stream entry: a record whose ``KIND`` names its type on the wire; a ``COMPRESSIBLE``
    kind is written deflated past `COMPRESS_FROM_BYTES` (the module docstring says why)."""

    KIND: ClassVar[str]
    COMPRESSIBLE: ClassVar[bool] = False

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.KIND, **super().to_wire()}


def encode(message: Message) -> bytes:
    packed = msgpack.packb(message.to_wire(), use_bin_type=True)
    if message.COMPRESSIBLE and len(packed) >= COMPRESS_FROM_BYTES:
        return zlib.compress(packed, 1)
    return packed


def inflate(payload: bytes) -> bytes:
    """A deflated payload's msgpack; a `ProtocolError` for one that is not whole zlib data or
    inflates past `MAX_INFLATED_BYTES` (never more is held)."""
    inflater = zlib.decompressobj()
    try:
        packed = inflater.decompress(payload, MAX_INFLATED_BYTES)
    except zlib.error as exc:
        raise ProtocolError(f"not deflated msgpack: {exc}") from None
    if inflater.unconsumed_tail:
        raise ProtocolError(f"inflates past {MAX_INFLATED_BYTES} bytes")
    if not inflater.eof:
        raise ProtocolError("deflated payload is cut short")
    return packed


def job_entries(payloads: list[bytes]) -> list[dict[bytes, bytes]]:
    """The fields of the entries that carry `payloads` (encoded jobs, in order) on a job
    stream: one bundle per `MAX_BUNDLE_JOBS` jobs or `MAX_BUNDLE_BYTES` bytes, and a plain
    single-job entry for a job that is alone in its bundle."""
    chunks: list[list[bytes]] = []
    size = 0
    for payload in payloads:
        if (
            not chunks
            or len(chunks[-1]) >= MAX_BUNDLE_JOBS
            or (size + len(payload) > MAX_BUNDLE_BYTES and chunks[-1])
        ):
            chunks.append([])
            size = 0
        chunks[-1].append(payload)
        size += len(payload)
    return [
        {ENTRY_FIELD: chunk[0]} if len(chunk) == 1
        else {JOBS_FIELD: msgpack.packb(chunk, use_bin_type=True)}
        for chunk in chunks
    ]  # fmt: skip


def job_payloads(fields: dict[bytes, bytes]) -> list[bytes | None]:
    """The job payloads an entry carries: its ``m`` (None if it has none, which `decode`
    refuses) or each job of its bundle. A `ProtocolError` for a malformed bundle, which is
    refused whole: no job in it can be trusted to be what its writer meant."""
    if JOBS_FIELD not in fields:
        return [fields.get(ENTRY_FIELD)]
    return list(bundle_payloads(fields))


def bundle_payloads(fields: dict[bytes, bytes]) -> list[bytes]:
    """The job payloads of a bundle entry (one with a ``jobs`` field); a `ProtocolError` for
    a malformed one."""
    bundle = fields[JOBS_FIELD]
    if ENTRY_FIELD in fields:
        raise ProtocolError("an entry with both an 'm' and a 'jobs' field: one or the other")
    if bundle[:1] == DEFLATED_MARK:
        raise ProtocolError("a deflated bundle of jobs: the job streams are written plain")
    try:
        jobs = msgpack.unpackb(bundle, raw=False, max_array_len=MAX_BUNDLE_JOBS)
    except ValueError as exc:  # msgpack's errors, and an array past the bound, are ValueErrors
        raise ProtocolError(f"bundle of jobs: not msgpack within {MAX_BUNDLE_JOBS} jobs: "
                            f"{exc}"[:1000]) from None  # fmt: skip
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"bundle of jobs: not msgpack: {exc}"[:1000]) from None
    if not isinstance(jobs, list) or not jobs:
        raise ProtocolError("bundle of jobs: must be a non-empty msgpack array of job "
                            f"payloads, got {_shape(jobs)}")  # fmt: skip
    wrong = sorted({_shape(job) for job in jobs if not isinstance(job, bytes)})
    if wrong:
        raise ProtocolError(f"bundle of jobs: each job must be msgpack bytes (bin), got "
                            f"{', '.join(wrong)}")  # fmt: skip
    return jobs


def _shape(value: Any) -> str:
    return "an empty array" if value == [] else type(value).__name__


def fields_of(message: Message) -> dict[str, Any]:
    """The message's fields as a plain dict (for logs and tests)."""
    return dataclasses.asdict(message)
