"""What every stage replica measures of its consumer-group loop (bus/actor.py)."""

from __future__ import annotations

from observability.metrics import ProcessMetrics

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HANDLE_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class StageMetrics:
    def __init__(self, process: ProcessMetrics) -> None:
        self.process = process
        self.entries = process.counter("stage_entries", "Stream entries this replica handled.")
        self.batch_size = process.histogram(
            "stage_batch_size", "Entries per batch read and handled.", BATCH_SIZE_BUCKETS
        )
        self.handle_seconds = process.histogram(
            "stage_handle_seconds", "Seconds to handle one batch, the commit included.",
            HANDLE_SECONDS_BUCKETS,
        )  # fmt: skip
        self.dead_letters = process.counter(
            "stage_dead_letters", "Entries this replica sent to the dead-letter stream."
        )
        self.claimed = process.counter(
            "stage_claimed_entries",
            "Entries taken over from a consumer that left them pending (XAUTOCLAIM).",
        )
