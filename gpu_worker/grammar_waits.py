"""Jobs whose grammar is compiling: the worker's engine thread never waits for a compile.

A job whose grammar is not compiled yet (`Grammars.compile_soon`) waits here while the
compile runs in jobs/grammar.py's pool and the engine goes on stepping the other requests.
Once the compile is done (its template cached, or its error kept) the worker admits the
job as any other; one still compiling at the deadline
(``STREAMSERVE_GRAMMAR_COMPILE_TIMEOUT_S``) is refused with a 400 naming its field.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

from jobs.field_error import FieldError
from jobs.grammar import too_slow
from jobs.protocol import TokenizedRequest
from jobs.request_bounds import request_bounds


@dataclass
class Waiting:
    entry_id: bytes
    job: TokenizedRequest
    progress: list[int]  # its published output, as the worker read it at admission
    field: str  # the grammar parameter being compiled
    compile: concurrent.futures.Future
    deadline: float  # time.monotonic()


class GrammarWaits:
    def __init__(self) -> None:
        self._waiting: dict[str, Waiting] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def rids(self) -> list[str]:
        return list(self._waiting)

    def park(self, waiting: Waiting) -> None:
        self._waiting[waiting.job.rid] = waiting

    def due(self) -> list[tuple[Waiting, FieldError | None]]:
        """The jobs to admit now (None) or to refuse (the error of a compile past its
        deadline); they are no longer waiting."""
        now = time.monotonic()
        due = [w for w in self._waiting.values() if w.compile.done() or now >= w.deadline]
        limit = request_bounds().grammar_compile_timeout_s
        for waiting in due:
            del self._waiting[waiting.job.rid]
        return [
            (w, None if w.compile.done() else FieldError(w.field, too_slow(w.field, limit)))
            for w in due
        ]

    def pop(self, rid: str) -> Waiting | None:
        return self._waiting.pop(rid, None)

    def clear(self) -> None:
        """Every job dropped (their entries are read again): their compiles go on."""
        self._waiting.clear()
