"""Chained hashes of a token sequence's full blocks: the names workers and routers share for
what a worker's prefix cache holds (docs/ARCHITECTURE.md, "KV-aware routing").

A sequence's block ``i`` is its tokens ``[i*B, (i+1)*B)``; its hash covers the block's tokens
and the hash of block ``i-1``, so one hash names the whole prefix that ends with the block:
two sequences share block ``i``'s hash only if they share their first ``(i+1)*B`` tokens.
Only full blocks are hashed (a partial last block is never cached by name).

The hash is blake2b with an 8-byte digest, read as an unsigned 64-bit integer: stable across
processes and machines (Python's ``hash()`` is salted per process), and a collision among the
few million blocks a deployment holds has odds of about 1e-7.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from jobs.wire import pack_ids

_TOKEN_BYTES = 4  # a token as on the wire: little-endian int32 (`pack_ids`)
ROOT_HASH = 0  # the "block" before the first: every chain starts from it
MAX_HASH = 2**64 - 1


def block_hashes(
    token_ids: Sequence[int], block_tokens: int, start: int = 0, parent: int | None = None
) -> list[int]:
    """The chained hashes of the full blocks of `token_ids`, from block `start` on.

    `parent` is the hash of block ``start - 1``: a caller that knows it hashes only the
    blocks from `start` on; without it the blocks before `start` are hashed too (the chain
    needs them) and left out of the answer.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1; got {block_tokens}")
    full = len(token_ids) // block_tokens
    if start >= full:
        return []
    if parent is None:
        if start > 0:
            return block_hashes(token_ids, block_tokens)[start:]
        parent = ROOT_HASH
    raw = pack_ids(token_ids[start * block_tokens : full * block_tokens])
    step = block_tokens * _TOKEN_BYTES
    hashes = []
    previous = parent
    for offset in range(0, len(raw), step):
        digest = hashlib.blake2b(
            previous.to_bytes(8, "little") + raw[offset : offset + step], digest_size=8
        ).digest()
        previous = int.from_bytes(digest, "little")
        hashes.append(previous)
    return hashes


def leading_run(hashes: Sequence[int], held: object) -> int:
    """How many of `hashes`, from the first, are in `held` (a set, or anything with ``in``):
    a cache reuses a prefix only up to its first missing block."""
    count = 0
    for block_hash in hashes:
        if block_hash not in held:  # type: ignore[operator]
            break
        count += 1
    return count
