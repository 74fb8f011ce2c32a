"""The ingress stage: an aiohttp server speaking OpenAI's API (and a native /generate).

server.py         the app and `run` (what ``streamserve stage ingress`` calls)
state.py          what the handlers share: Redis client, reply reader, admission, aborts
handlers.py       the endpoints
params.py         request bodies checked and turned into GenerateRequests
body.py           JSON reading and typed field access (a wrong JSON type is a 422)
submission.py     one HTTP request's sub-requests, from XADD to their last reply
openai_format.py  OpenAI response bodies, stream chunks and logprobs
health.py         live workers (cached) and queue depth, for admission and /health
metrics.py        this replica's Prometheus metrics (prometheus-client); /metrics serves all
errors.py         OpenAI-style error bodies and the middleware that makes every failure one
"""
