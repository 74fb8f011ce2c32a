"""A worker's new jobs, read off its stream by a thread of their own.

The engine loop publishes at most every ``publish_interval_ms`` while it has work, and
each of those commits used to carry a non-blocking XREADGROUP of new jobs: one Redis
command per publish whether or not a job had arrived, a tenth of what a publish costs the
bus down the chain and 0.26 commands a token at batch 1 (issue 27). This thread instead
blocks on the stream (``block_ms`` at a time, as an idle worker did), so a read costs a
command when jobs arrive, or once per ``block_ms`` when none do, whatever the step rate;
the loop takes what it read at its next turn, and waits here when it has nothing to run.
After a read that found jobs the thread waits ``publish_interval_ms`` before the next, so
jobs arriving faster than that are read together (and their abort flags checked in one
MGET at admission): never more reads than the commits made, and a job waits for its read
no longer than it waited for the next commit's.
An Abort the owning ingress writes to the stream reaches the loop as soon as it is read,
no longer only at the next publish.

A read takes the entries into this consumer's pending list as it did in the commit, so
nothing is lost if the worker dies holding them (bus/fenced_stream.py). After a fence the
loop drops what this thread read and reads the whole pending list again; `paused` keeps a
read from landing in between, so no entry is both in that list and read here.

Without the thread (a worker driven turn by turn, as tests do) the loop reads in its
commits as before: `running` says which.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from bus.fenced_stream import Entry, FencedStream
from bus.reconnect import ReconnectingLoop

logger = logging.getLogger(__name__)

RETRY_S = 0.5  # after a read failed on something else than an outage or a lost group


class JobIntake:
    def __init__(self, bus: FencedStream, stop: threading.Event) -> None:
        self.bus = bus
        self.stop = stop
        self._read: list[Entry] = []
        self._arrived = threading.Condition()
        self._reading = threading.Lock()  # held through a read and the keeping of its entries
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"intake-{self.bus.worker_id}",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def take(self, wait_s: float = 0.0) -> list[Entry]:
        """What was read since the last take, waiting up to `wait_s` for something."""
        with self._arrived:
            if not self._read and wait_s > 0:
                self._arrived.wait(wait_s)
            read, self._read = self._read, []
        return read

    def wait(self) -> list[Entry]:
        """Nothing to run: what arrives within ``block_ms`` (read here when no thread runs)."""
        if not self.running:
            return self.bus.read_blocking()
        return self.take(self.bus.config.block_ms / 1000)

    def wake(self) -> None:
        """End a `take` waiting for arrivals now (a stop: the worker's loop then sees it);
        safe in a signal handler of the waiting thread, the condition's lock being an RLock."""
        with self._arrived:
            self._arrived.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No read in flight, and what was read dropped: the pending list is read whole."""
        with self._reading:
            with self._arrived:
                self._read = []
            yield

    def _run(self) -> None:
        # Through outages and a lost group (a Redis restarted empty), as the loop goes on.
        loop = ReconnectingLoop(f"worker {self.bus.worker_id}'s intake", self.stop,
                                self.bus.ensure_group)  # fmt: skip
        while not self.stop.is_set():
            try:
                loop.run(self._read_and_wait, group_made=True)
            except Exception:  # never end the thread: a worker that reads nothing looks alive
                logger.exception("worker %s: reading new jobs", self.bus.worker_id)
                self.stop.wait(RETRY_S)

    def _read_and_wait(self) -> None:
        with self._reading:
            entries = self.bus.read_blocking()  # up to block_ms
            if entries:
                with self._arrived:
                    self._read += entries
                    self._arrived.notify()
        if entries:  # the next arrivals read together (the module docstring says why)
            self.stop.wait(self.bus.config.publish_interval_ms / 1000)
