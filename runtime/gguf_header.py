"""A GGUF file's header metadata, read key by key without loading the file (no gguf package,
no numpy): what the CPU stages and the synthetic worker need to know of a model (its
context length, vocabulary size, end-of-sequence id) before or instead of loading it.

The header comes before the tensors; each key is read as it comes, so a reader stops as
soon as it has what it wants. Arrays (the tokenizer's tokens and merges) are skipped, and
given by their length only.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

GGUF_MAGIC = b"GGUF"
# GGUF value types -> struct format of a scalar of that type (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFArray:
    """An array value, skipped: only its length is read."""

    length: int


def gguf_metadata(file: BinaryIO) -> Iterator[tuple[str, int | float | bool | str | GGUFArray]]:
    """Each (key, value) of the header in file order; nothing if `file` is not GGUF. Raises
    ValueError or struct.error on a damaged header."""
    if file.read(4) != GGUF_MAGIC:
        return
    _version, _tensors, count = struct.unpack("<IQQ", file.read(20))
    for _ in range(count):
        key = _string(file)
        kind = _unpack(file, "I")
        if kind in _SCALARS:
            yield key, _unpack(file, _SCALARS[kind])
        elif kind == _STRING:
            yield key, _string(file)
        elif kind == _ARRAY:
            item_kind, length = _unpack(file, "I"), _unpack(file, "Q")
            _skip_items(file, item_kind, length)
            yield key, GGUFArray(length)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")


def _unpack(file: BinaryIO, fmt: str):
    size = struct.calcsize("<" + fmt)
    return struct.unpack("<" + fmt, file.read(size))[0]


def _string(file: BinaryIO) -> str:
    return file.read(_unpack(file, "Q")).decode("utf-8", "replace")


def _skip_items(file: BinaryIO, kind: int, length: int) -> None:
    if kind in _SCALARS:
        file.seek(length * struct.calcsize("<" + _SCALARS[kind]), 1)
        return
    for _ in range(length):
        if kind == _STRING:
            file.seek(_unpack(file, "Q"), 1)
        elif kind == _ARRAY:
            item_kind, inner = _unpack(file, "I"), _unpack(file, "Q")
            _skip_items(file, item_kind, inner)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")
