"""A worker's weights: which version it serves, and moving to the version the fleet wants.

The fleet's record (jobs/weights.py) is read by the heartbeat thread at every beat and
handed to `noticed`. When it names a version this worker does not serve (and has not
already failed to load), the worker (gpu_worker/worker.py) updates:

1. It stops admitting: jobs read stay in its inbox, pending, so nothing is lost, and a job
   that arrives during the update runs on the new weights. It goes on reading its stream
   for aborts (`split_aborts`): a client that leaves during the drain stops its request.
2. It drains: the requests already running finish on the old weights. Drain, not keep (stop
   and resume them on the new weights), because a request computed partly by each version
   would name neither, and its KV would have to be recomputed anyway; the cost is that the
   update waits for the longest running request.
3. It flushes the prefix cache (old KV is not valid for new weights; the routers hear of it
   through the cache's `cleared` event) and empties the KV pool, which the check uses.
4. It loads the new weights beside the old ones, checks them and copies them in
   (gpu_worker/model_executor/weight_swap.py).
5. It resumes: the heartbeat and every Finish from now on name the new version.

A load that fails (a missing path, another shape, a failed self-check, out of memory)
changes nothing but the error the heartbeat reports (``weights_error``, "<version>:
<why>"), and a log line; the worker serves the old weights, and does not try that version
again (a new admin call makes a new version). No admin message's content can end the
worker: everything the update raises is caught here.

Paused seconds (from the stop of admission to the resume) are logged per update, with the
drain and the load apart, and kept in `history`.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bus.fenced_stream import Entry
from jobs.protocol import ENTRY_FIELD, Abort, ProtocolError, decode
from jobs.weights import WeightsRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Update:
    """One update as this worker lived it."""

    version: str
    ok: bool
    drain_seconds: float  # from the stop of admission until nothing ran
    load_seconds: float  # flush, load, check and swap
    error: str | None = None

    @property
    def paused_seconds(self) -> float:
        return self.drain_seconds + self.load_seconds


class WeightsUpdates:
    def __init__(
        self, worker_id: str, version: str, error: str | None = None, failed: tuple[str, ...] = (),
        source: str | None = None,
    ) -> None:  # fmt: skip
        self.worker_id = worker_id
        self.version = version  # the weights serving now
        self.source = source  # what they were loaded from (None: the worker's model argument)
        self.error = error  # why the last update (or the start's record) failed
        self.history: list[Update] = []
        self._wanted: WeightsRecord | None = None  # the fleet's record, set by the heartbeat
        self._failed: set[str] = set(failed)  # versions that would not load here: not tried again
        self._paused_at: float | None = None  # monotonic time admission stopped
        # Loading: the loop does not turn, and is not hung (the heartbeat's stall check).
        self.loading = False

    # ---- the heartbeat thread -------------------------------------------------------------

    def noticed(self, raw: Mapping[Any, Any]) -> None:
        """The record as HGETALL read it. One written by hand without a source or version
        is reported (it is not an update) and the worker serves on."""
        try:
            self._wanted = WeightsRecord.from_mapping(raw)
        except ValueError as exc:
            if self.error != str(exc):
                logger.error("worker %s: %s; serving %s", self.worker_id, exc, self.version)
            self.error = str(exc)

    @property
    def target(self) -> str | None:
        """The version this worker is draining for or loading (None: not updating)."""
        return None if self._paused_at is None else self._version_due()

    # ---- the worker's loop -----------------------------------------------------------------

    def due(self) -> WeightsRecord | None:
        """The record to update to now, if any: admission stops until `apply` returns."""
        record = self._wanted
        if record is None or self._version_due() is None:
            self._paused_at = None  # (the record went back to what serves, mid-drain)
            return None
        if self._paused_at is None:
            self._paused_at = time.monotonic()
            logger.info("worker %s: weights %s wanted (serving %s): draining, admitting nothing",
                        self.worker_id, record.version, self.version)  # fmt: skip
        return record

    def apply(self, engine: Any, record: WeightsRecord) -> Update:
        """Flush, load, check and swap, the engine drained; never raises (see the module)."""
        paused_at = self._paused_at if self._paused_at is not None else time.monotonic()
        started = time.monotonic()
        error = None
        self.loading = True
        try:
            _swap(engine, record.source)
        except Exception as exc:  # whatever the named weights do, the worker serves on
            error = f"{record.version}: {exc}"
        finally:
            self.loading = False
            gc.collect()  # the rejected (or copied-from) model's tensors go now, not later
            _release_cached_gpu_memory(engine)
        done = time.monotonic()
        update = Update(record.version, error is None, started - paused_at, done - started, error)
        self.history.append(update)
        self._paused_at = None
        if error is None:
            logger.info("worker %s: weights %s -> %s (%s) in %.2f s paused (drain %.2f s, "
                        "load and check %.2f s)", self.worker_id, self.version, record.version,
                        record.source, update.paused_seconds, update.drain_seconds,
                        update.load_seconds)  # fmt: skip
            self.version, self.source, self.error = record.version, record.source, None
        else:
            logger.error("worker %s: weights %s not loaded, serving %s: %s", self.worker_id,
                         record.version, self.version, error)  # fmt: skip
            self._failed.add(record.version)
            self.error = error
        return update

    def _version_due(self) -> str | None:
        record = self._wanted
        if record is None or record.version == self.version or record.version in self._failed:
            return None
        return record.version


def _swap(engine: Any, source: str) -> None:
    runner = engine.runner
    if getattr(runner, "model", None) is None:
        raise ValueError("this worker's engine has no weights to update (a synthetic engine)")
    tp = getattr(getattr(runner, "config", None), "tp", 1)
    if tp > 1:  # each rank would have to load its share: not built yet (docs/TENSOR_PARALLEL.md)
        raise ValueError(f"weight updates do not support tensor parallelism yet (--tp {tp})")
    if not engine.flush_cache():
        raise RuntimeError("requests are still running; nothing changed")  # drained first: a bug
    # Imported here: torch and the loader, which a synthetic worker never imports.
    from gpu_worker.model_executor.weight_swap import load_checked, swap_in

    swap_in(runner, load_checked(runner, source))


def _release_cached_gpu_memory(engine: Any) -> None:
    device = getattr(getattr(engine, "runner", None), "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.empty_cache()


def split_aborts(entries: list[Entry]) -> tuple[list[tuple[bytes, str]], list[Entry]]:
    """What a draining worker read: the aborts (entry id, rid), to act on now, and the rest,
    kept in order for after the update (a malformed entry is set aside then, as always)."""
    aborts, kept = [], []
    for entry_id, fields in entries:
        try:
            aborts.append((entry_id, decode((fields or {}).get(ENTRY_FIELD), Abort).rid))
        except ProtocolError:
            kept.append((entry_id, fields))
    return aborts, kept
