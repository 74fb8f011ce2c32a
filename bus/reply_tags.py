"""A reply stream's requests named by tags: short numbers in place of their rids.

A reader gives each job it submits a ``tag`` (jobs/requests.py), counting from 0: unique on
its reply stream, which no other reader owns. The job's bundled deltas then carry the tag,
and its rid only on its first delta (``seq`` 0): a 34-character rid per request per publish,
on the tokens stream and again on the reply stream, was the largest part of their bytes per
generated token (issue 27).

A reader that replays a stream it did not write the jobs of (an ingress resuming a dead
replica's request: stages/ingress/streaming/resume.py) knows its rids, not their tags: it
learns each from the request's first delta, which names both. Detokenizer replicas race, so
a later delta may land a few entries before the first one: until a waiting rid is named,
deltas of tags nobody named are held (the last `MAX_UNNAMED`; a race spans a publish or two,
never thousands of deltas) and filed once their tag is named.
"""

from __future__ import annotations

import collections

from jobs.protocol import TextDelta

MAX_UNNAMED = 4096


class ReplyTags:
    """Tag <-> rid for one reply stream's reader (sans I/O, as `ReplyRouter`)."""

    def __init__(self) -> None:
        self._next = 0
        self.rid_of: dict[int, str] = {}  # the rid each tag names (others only read it)
        self._tag_of: dict[str, int] = {}
        self._waiting: set[str] = set()  # registered rids whose tag this reader did not give
        self._unnamed: collections.deque[tuple[bytes, TextDelta]] = collections.deque(
            maxlen=MAX_UNNAMED
        )

    def expect(self, rid: str) -> None:
        """`rid` is registered without a tag: its first delta names it, if it has one."""
        if rid not in self._tag_of:
            self._waiting.add(rid)

    def give(self, rid: str) -> int:
        """A new tag for `rid`, the job this reader is about to submit."""
        tag = self._next
        self._next += 1
        self._learn(rid, tag)
        return tag

    def forget(self, rid: str) -> None:
        tag = self._tag_of.pop(rid, None)
        if tag is not None:
            self.rid_of.pop(tag, None)
        self._waiting.discard(rid)

    def name(self, entry_id: bytes, delta: TextDelta) -> list[tuple[bytes, TextDelta]]:
        """(entry id, delta) to file for `delta`, each with its ``rid`` set: none while its tag
        names nobody this reader waits for (held while a rid waits for its name); with the
        first delta of a waiting rid, the deltas of its tag held before it."""
        tag = delta.tag
        if tag is None:
            return [(entry_id, delta)]
        if delta.rid is not None:
            if delta.rid not in self._waiting or tag in self.rid_of:
                return [(entry_id, delta)]
            self._learn(delta.rid, tag)
            held = [pair for pair in self._unnamed if pair[1].tag == tag]
            if held:
                self._unnamed = collections.deque(
                    (pair for pair in self._unnamed if pair[1].tag != tag), maxlen=MAX_UNNAMED
                )
            for _, earlier in held:
                earlier.rid = delta.rid
            return [*held, (entry_id, delta)]
        rid = self.rid_of.get(tag)
        if rid is not None:
            delta.rid = rid
            return [(entry_id, delta)]
        if self._waiting:
            self._unnamed.append((entry_id, delta))
        return []  # a late delta of a request nobody waits for any more

    def _learn(self, rid: str, tag: int) -> None:
        self.rid_of[tag] = rid
        self._tag_of[rid] = tag
        self._waiting.discard(rid)
