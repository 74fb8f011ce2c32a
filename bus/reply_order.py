"""One request's replies put back in output order (`ReplyOrderer`): detokenizer replicas race,
so its deltas can land on its reply stream out of order or twice (bus/replies.py reads them).
"""

from __future__ import annotations

from jobs.protocol import ErrorReply, TextDelta

Reply = TextDelta | ErrorReply


class ReplyOrderer:
    """One request's replies, released in output order.

    A delta is released once every token before its ``seq`` has been; one with ``seq`` below
    the next expected index is a copy and is dropped. A finish delta without ids carries the
    expected index as its ``seq``, so it waits for the tokens before it like any other. An
    ErrorReply ends the request at once, whatever is still missing.
    """

    def __init__(self) -> None:
        self.next_seq = 0
        self.done = False
        self._held: dict[int, TextDelta] = {}

    def is_next(self, seq: int) -> bool:
        """Whether a delta at `seq` (not a finish) is released as it comes: the next one, with
        none held before it. Its taker then moves `next_seq` past its tokens."""
        return seq == self.next_seq and not self._held and not self.done

    def push(self, message: Reply) -> list[Reply]:
        if self.done:
            return []
        if isinstance(message, ErrorReply):
            self.done = True
            self._held.clear()
            return [message]
        if message.seq < self.next_seq or (not message.count and message.finish is None):
            return []  # a copy, or a delta that carries nothing
        if message.finish is None and self.is_next(message.seq):
            self.next_seq += message.count  # the next one, nothing held: most deltas
            return [message]
        self._held.setdefault(message.seq, message)
        released: list[Reply] = []
        while self.next_seq in self._held:
            delta = self._held.pop(self.next_seq)
            released.append(delta)
            if delta.finish is not None:
                self.done = True
                self._held.clear()
                break
            self.next_seq += delta.count
        return released
