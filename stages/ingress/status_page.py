"""The operators' live view at the ingress: `/status`, a page that draws the pipeline, and
`/status.json`, the deployment's status it refreshes from every second (the dict of
observability/deployment_status.py, which `streamserve status --url` reads too).

The page is one static file shipped in the package (static/status.html: plain HTML, CSS and
JS, no build step, nothing fetched from elsewhere). Both routes stay open with API keys
(auth.py), as /metrics does: a browser's page load sends no Authorization header.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import redis
from aiohttp import web

from observability.cluster_status import read_deployment_status
from stages.ingress.errors import redis_unavailable
from stages.ingress.state import STATE

STATUS_PAGE = Path(__file__).parent / "static" / "status.html"


async def status_page(request: web.Request) -> web.FileResponse:
    # no-cache: a page from an older release must not outlive an upgrade in the browser.
    return web.FileResponse(STATUS_PAGE, headers={"Cache-Control": "no-cache"})


async def status_json(request: web.Request) -> web.Response:
    state = request.app[STATE]
    loop = asyncio.get_running_loop()
    try:  # its Redis calls are blocking: off the event loop
        status = await loop.run_in_executor(None, read_deployment_status, state.sync_shards)
    except redis.RedisError as exc:
        raise redis_unavailable(exc) from exc
    return web.json_response(status, headers={"Cache-Control": "no-store"})
