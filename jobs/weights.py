"""The weights the fleet serves: one record in Redis, the fleet's truth.

``<p>:weights`` is a hash: ``source`` (a path or model name every worker resolves as its
``--model``), ``version`` (``w<serial>-<8 hex of the source>``), ``set_at`` (Unix time), and
``serial``, a counter the admin call increments. The admin call (``POST /admin/weights``,
``streamserve weights update``) writes it; nothing else does.

Why a record and not a message on each worker's stream: a worker reads it when it starts (so a
worker started after an update loads the new version, whatever its command line says) and at
every heartbeat, in the heartbeat's own round trip, so no extra one. That is level-triggered:
a worker that was restarting, fenced or partitioned when the update was made still converges,
a repeated call cannot make a worker load twice, and there is no message for the reaper to move
off a dead worker's stream or for a worker to dead-letter. The price is latency: a worker
notices within one heartbeat interval (1 s by default), which is small beside loading weights.

A worker that has no record to read serves its command line's model as version
``w0-<8 hex of it>`` (`initial_version`): workers started alike report the same version.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jobs.field_error import FieldError
from runtime.config import BusConfig

MAX_SOURCE_CHARS = 4096  # a path or model name; longer is a mistake, not a checkpoint


@dataclass(frozen=True)
class WeightsRecord:
    source: str
    version: str
    set_at: float = 0.0

    def to_mapping(self) -> dict[str, str]:
        return {"source": self.source, "version": self.version, "set_at": repr(self.set_at)}

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "version": self.version, "set_at": self.set_at}

    @classmethod
    def from_mapping(cls, raw: Mapping[Any, Any]) -> WeightsRecord | None:
        """The record from HGETALL's answer; None when none was ever set. A record written by
        hand without a source or version raises ValueError (the worker reports it and goes on
        serving what it serves)."""
        fields = {_text(key): _text(value) for key, value in raw.items()}
        if "source" not in fields and "version" not in fields:
            return None  # no record (a lone serial is a counter with no record yet)
        source, version = fields.get("source", ""), fields.get("version", "")
        if not source or not version:
            raise ValueError(f"the weights record has no source or version: {fields}")
        try:
            set_at = float(fields.get("set_at", "0"))
        except ValueError:
            set_at = 0.0
        return cls(source, version, set_at)


def weights_key(config: BusConfig) -> str:
    """The record's key, ``<p>:weights``."""
    return config.key_name("weights")


def version_of(serial: int, source: str) -> str:
    """A version names its update (the serial) and what it loads (a hash of the source)."""
    return f"w{serial}-{hashlib.sha1(source.encode()).hexdigest()[:8]}"


def initial_version(model: str) -> str:
    """The version of weights loaded from a worker's command line, with no record set."""
    return version_of(0, model)


def new_record(serial: int, source: str) -> WeightsRecord:
    return WeightsRecord(source, version_of(serial, source), time.time())


def check_source(body: object) -> str:
    """The source an admin call names: ``{"model": "<path or name>"}``; a FieldError names
    what is wrong (the ingress's 400, the CLI's message)."""
    if not isinstance(body, Mapping):
        raise FieldError("model", 'the body must be a JSON object: {"model": "<path or name>"}')
    unknown = sorted(set(body) - {"model"})
    if unknown:
        raise FieldError(unknown[0], f"unknown field {unknown[0]!r}; only 'model' is accepted")
    source = body.get("model")
    if not isinstance(source, str) or not source.strip():
        raise FieldError("model", "model must be a non-empty string: a path or a model name")
    if len(source) > MAX_SOURCE_CHARS or any(ord(c) < 32 for c in source):
        raise FieldError("model", f"model must be at most {MAX_SOURCE_CHARS} printable characters")
    return source.strip()


def fleet_view(record: WeightsRecord | None, beats: list[Any]) -> dict[str, Any]:
    """What ``GET /admin/weights`` and ``streamserve weights status`` show: the version asked
    for and each live worker's (`beats`: their Heartbeats). ``converged``: every live worker
    serves the version asked for or failed to load it (its ``error`` says why)."""
    workers = [
        {"id": beat.worker_id, "version": beat.weights_version, "updating_to": beat.weights_target,
         "error": beat.weights_error}
        for beat in sorted(beats, key=lambda b: b.worker_id)
    ]  # fmt: skip
    wanted = None if record is None else record.version
    settled = [
        wanted is None or w["version"] == wanted or (w["error"] or "").startswith(wanted)
        for w in workers
    ]
    return {
        "object": "weights",
        "desired": None if record is None else record.to_json(),
        "workers": workers,
        "converged": all(settled) and not any(w["updating_to"] for w in workers),
    }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
