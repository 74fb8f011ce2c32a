"""The ingress's HTTP API: OpenAI's endpoints and the native /generate.

handlers.py          the generation endpoints (chat, completions, /generate)
sse.py               their event streams, written in as few sends as the replies allow
embeddings.py        /v1/embeddings: pooled hidden states, one embedding job per input
service_endpoints.py the rest: models, aborts, OpenAPI document, health, metrics
admin_weights.py     /admin/weights: new weights for every worker, behind the admin key
params.py            request bodies checked and turned into GenerateRequests
openai_format.py     OpenAI response bodies, stream chunks and logprobs
native_format.py     the native /generate bodies
response_format.py   `response_format` into a grammar
tool_request.py      `tools` and `tool_choice` into the prompt and a grammar
tool_call_parser.py  tool calls parsed back out of the model's text
openapi.py           the OpenAPI document of the API
openapi_schemas.py   its request schemas, built from the parsers' tables
"""
