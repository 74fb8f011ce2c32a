"""A streaming completion client that does what a careful user's client would: when the
stream breaks (its ingress died), it sends the request again with ``Last-Event-ID`` until a
replica resumes it. It records when each chunk arrived, for latency and recovery figures.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

RETRY_S = 0.25
RESUME_TIMEOUT_S = 120.0


@dataclass
class StreamResult:
    sent_at: float
    chunk_times: list[float] = field(default_factory=list)  # monotonic, chunks with text
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    resumes: int = 0
    error: str | None = None
    done_at: float | None = None

    def next_chunk_after(self, moment: float) -> float | None:
        return next((t for t in self.chunk_times if t > moment), None)


class _Broken(Exception):
    pass


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    result: StreamResult | None = None,
) -> StreamResult:
    """POST /v1/completions with stream and usage; resumed after any break. Pass `result`
    to watch it fill while the stream runs."""
    # Resumable: each event carries its id (streams carry none unless asked).
    body = {**body, "stream": True, "stream_options": {"include_usage": True, "resumable": True}}
    result = result if result is not None else StreamResult(time.monotonic())
    last_id: str | None = None
    deadline = 0.0
    while True:
        headers = {"Last-Event-ID": last_id} if last_id else {}
        try:
            async with session.post(url + "/v1/completions", json=body, headers=headers) as reply:
                if last_id and reply.status in (409, 503):
                    raise _Broken(f"HTTP {reply.status}")  # the dead replica not known yet
                if reply.status != 200:
                    result.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
                    return result
                if last_id:
                    result.resumes += 1
                done, last_id = await _read_events(reply, result, last_id)
                if done:
                    result.done_at = time.monotonic()
                    return result  # [DONE], or an error event (in result.error)
                raise _Broken("the stream ended without [DONE]")
        except (_Broken, aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            if last_id is None:
                result.error = f"{type(exc).__name__}: {exc}"
                return result
            deadline = deadline or time.monotonic() + RESUME_TIMEOUT_S
            if time.monotonic() > deadline:
                result.error = f"could not resume: {exc}"
                return result
            await asyncio.sleep(RETRY_S)


async def _read_events(
    reply: aiohttp.ClientResponse, result: StreamResult, last_id: str | None
) -> tuple[bool, str | None]:
    """Relay events into `result`: (True, _) at [DONE] or an error event, (False, the last
    event id received) when the stream breaks."""
    event_id = None
    try:
        async for raw in reply.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("id: "):
                event_id = line[4:]
            elif line == "data: [DONE]":
                return True, last_id
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return True, last_id
                _take(result, chunk)
                last_id = event_id or last_id
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
        pass
    return False, last_id


def _take(result: StreamResult, chunk: dict[str, Any]) -> None:
    if chunk.get("usage"):
        result.completion_tokens = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices", []):
        if choice.get("text"):
            result.chunk_times.append(time.monotonic())
            result.text += choice["text"]
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
