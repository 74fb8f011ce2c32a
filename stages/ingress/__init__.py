"""The ingress stage: an aiohttp server speaking OpenAI's API (and a native /generate).

server.py         the app and `run` (what ``streamserve stage ingress`` calls)
state.py          what the handlers share: Redis client, reply reader, admission, aborts
request_writes.py the requests' starts (MULTI; token-id prompts straight to the router)
                  and ends (DEL, aborts), gathered per turn
shards.py         a Redis Cluster's shards: its own, the home shard, requests found on any
body.py           JSON reading and typed field access (a wrong JSON type is a 422)
errors.py         OpenAI-style error bodies and the middleware that makes every failure one
health.py         live workers (cached) and queue depth, for admission and /health
metrics.py        this replica's Prometheus metrics (prometheus-client); /metrics serves all
connections.py    slow clients: read deadlines and the connection cap
status_page.py    /status, the operators' live view (static/status.html)
api/              the endpoints: bodies checked, requests made, answers formatted
batches/          OpenAI's Batch API: /v1/files, /v1/batches and the runner
responses/        OpenAI's Responses API (/v1/responses) over the chat path, stored responses
tenancy/          API keys, tenants, their limits and what each may see
streaming/        one HTTP request's sub-requests on the bus, and streams resumed
"""
