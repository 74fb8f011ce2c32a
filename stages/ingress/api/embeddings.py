"""POST /v1/embeddings: OpenAI's embeddings, from the served model's own hidden states.

Each input is one embedding job on the bus, fanned out as a request's choices are (rid
``<request id>-<index>``): a GenerateRequest with ``pooling`` (jobs/requests.py), which goes
through the tokenizer (text) or straight to the router (token ids), then to a worker, like
any job. The worker runs its prompt's prefill
only, batched and chunked with the other prefills, and pools the final hidden states (after
the model's final norm, before lm_head) over the whole prompt, computed afresh (the prefix
cache serves an embedding nothing: gpu_worker/scheduling/pooling.py); the vector comes back
L2-normalized, as packed float32 in the job's one reply (`TextDelta.embedding`).

The body: ``input`` (a string, a list of strings, a list of token ids, or a list of such
lists; none empty, at most ``STREAMSERVE_MAX_CHOICES`` inputs, their size within
``STREAMSERVE_MAX_REQUEST_PROMPT_TOKENS``, each within the model's context), ``model``,
``encoding_format`` (``float``, the default, or ``base64``: little-endian float32, as
OpenAI's client decodes it), ``dimensions`` (the first that many components, normalized
again: Matryoshka-style truncation; above the model's hidden size a 400) and ``user``
(accepted, unused). The extension field ``pooling`` picks the pooling: ``mean`` over the
prompt's tokens (the default: it needs no special token at the end, which a chat model's
plain text lacks) or ``last``, the last token's state (what decoder embedding models trained
with an end token use).
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web

from jobs.protocol import MAX_TOKEN_ID, ErrorReply, GenerateRequest, TextDelta
from jobs.request_bounds import request_bounds
from jobs.requests import POOLINGS
from stages.ingress.api.params import check_model, check_prompt_size, token_ids
from stages.ingress.body import INT, STR, field, read_object, reject_unknown, wrong_type
from stages.ingress.errors import ApiError
from stages.ingress.state import STATE
from stages.ingress.streaming.submission import Submission
from stages.ingress.tenancy.auth import bearer_key
from stages.ingress.tenancy.ownership import owner_of

FIELDS = {"input", "model", "encoding_format", "dimensions", "user", "pooling"}
ENCODINGS = ("float", "base64")
DEFAULT_POOLING = "mean"
# An embedding job samples nothing: its prompt alone must fit the context.
EMBEDDING_SAMPLING = {"max_new_tokens": 0}


@dataclass
class EmbeddingRequest:
    """What one /v1/embeddings body asks for."""

    inputs: list[dict[str, Any]]  # each: GenerateRequest's prompt or input_ids
    encoding_format: str = "float"
    dimensions: int | None = None
    pooling: str = DEFAULT_POOLING

    def jobs(
        self, request_id: str, reply_to: str, tenant: str, weight: float, priority: int | None
    ) -> list[GenerateRequest]:
        created = time.time()
        return [
            GenerateRequest(rid=f"{request_id}-{i}", reply_to=reply_to,
                            sampling=dict(EMBEDDING_SAMPLING), created=created, tenant=tenant,
                            weight=weight, priority=priority, bundle_replies=True,
                            pooling=self.pooling, **prompt)
            for i, prompt in enumerate(self.inputs)
        ]  # fmt: skip

    def data_item(self, index: int, packed: bytes) -> dict[str, Any]:
        """One input's entry of the answer, truncated to `dimensions` and encoded."""
        vector = np.frombuffer(packed, dtype="<f4")
        if self.dimensions is not None:
            if self.dimensions > vector.shape[0]:
                raise ApiError(400, f"dimensions must be at most {vector.shape[0]} (the model's "
                               f"hidden size), got {self.dimensions}", param="dimensions",
                               code="invalid_value")  # fmt: skip
            vector = vector[: self.dimensions].astype(np.float64)
            vector = (vector / max(np.linalg.norm(vector), 1e-12)).astype("<f4")
        if self.encoding_format == "base64":
            encoded: Any = base64.b64encode(vector.tobytes()).decode("ascii")
        else:
            encoded = vector.tolist()
        return {"object": "embedding", "index": index, "embedding": encoded}


def parse_embeddings(data: dict[str, Any], served: str) -> EmbeddingRequest:
    reject_unknown(data, FIELDS)
    check_model(data, served)
    if "input" not in data or data["input"] is None:
        raise ApiError(400, "input is required", param="input", code="missing_field")
    inputs = embedding_inputs(data["input"])
    limit = request_bounds().max_choices
    if len(inputs) > limit:
        raise ApiError(400, f"at most {limit} inputs per request, got {len(inputs)}",
                       param="input", code="invalid_value")  # fmt: skip
    check_prompt_size(inputs, 1, "input")
    encoding = _or_default(field(data, "encoding_format", STR), "float")
    if encoding not in ENCODINGS:
        raise _invalid("encoding_format", f"must be float or base64, got {encoding!r}")
    dimensions = field(data, "dimensions", INT)
    if dimensions is not None and dimensions < 1:
        raise _invalid("dimensions", f"must be at least 1, got {dimensions}")
    pooling = _or_default(field(data, "pooling", STR), DEFAULT_POOLING)
    if pooling not in POOLINGS:
        raise _invalid("pooling", f"must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    field(data, "user", STR)
    return EmbeddingRequest(inputs, encoding, dimensions, pooling)


def embedding_inputs(value: Any) -> list[dict[str, Any]]:
    """A string, strings, token ids or lists of token ids: one prompt dict each."""
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise wrong_type("input", value, "a string or an array")
    if not value:
        raise _invalid("input", "must not be empty")
    if all(isinstance(item, str) for item in value):
        empty = next((i for i, text in enumerate(value) if not text), None)
        if empty is not None:
            raise _invalid("input", f"input[{empty}] must not be an empty string", prefix=False)
        return [{"prompt": text} for text in value]
    if all(isinstance(item, list) for item in value):
        return [{"input_ids": token_ids(ids, "input")} for ids in value]
    return [{"input_ids": token_ids(value, "input")}]


def _or_default(value: str | None, default: str) -> str:
    return default if value is None else value  # "" is a value, and a wrong one


def _invalid(name: str, problem: str, prefix: bool = True) -> ApiError:
    message = f"{name} {problem}" if prefix else problem
    return ApiError(400, message, param=name, code="invalid_value")


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    job = parse_embeddings(await read_object(request), state.model)
    tenant = state.tenants.for_key(bearer_key(request))
    priority = tenant.priority_of(None)
    await state.admit(len(job.inputs))
    request_id = "emb-" + uuid.uuid4().hex
    jobs = job.jobs(request_id, state.reply_stream, tenant.id, tenant.weight, priority)
    owner = owner_of(request, state.tenants)
    vectors: list[bytes | None] = [None] * len(jobs)
    prompt_tokens = 0
    async with Submission(state, request_id, jobs, tenant=tenant, owner=owner) as sub:
        try:
            await sub.first_replies()
        except ApiError as error:
            raise _named_input(error) from None
        async for reply in sub.replies():
            if isinstance(reply, ErrorReply):
                raise _named_input(ApiError.from_reply(reply))
            index = sub.index[reply.rid]
            vectors[index] = reply.embedding if reply.embedding is not None else vectors[index]
            prompt_tokens += _prompt_tokens(reply)
    data = [job.data_item(i, _vector(i, packed)) for i, packed in enumerate(vectors)]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    body = {"object": "list", "data": data, "model": state.model, "usage": usage}
    return web.json_response(body)


def _prompt_tokens(reply: TextDelta) -> int:
    finish = reply.finish_info()
    return 0 if finish is None else finish.prompt_tokens


def _vector(index: int, packed: bytes | None) -> bytes:
    if packed is None:  # a job that ended without one: aborted (a worker's stall, a shutdown)
        raise ApiError(500, f"the embedding of input {index} was not computed",
                       "internal_error", None, "internal_error")  # fmt: skip
    return packed


def _named_input(error: ApiError) -> ApiError:
    """A refusal found downstream names the job's prompt field: here it is ``input``."""
    if error.param in ("prompt", "input_ids"):
        error.param = "input"
    return error


# ---- OpenAPI (stages/ingress/api/openapi.py puts these in its document) ---------------------


def openapi_request() -> dict[str, Any]:
    """The EmbeddingRequest schema: what `parse_embeddings` takes."""
    most = request_bounds().max_choices
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
           "minItems": 1}  # fmt: skip
    text = {"type": "string", "minLength": 1}
    properties = {
        "input": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": most},
                            ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": most}],
                  "description": "a string, strings, token ids or lists of token ids"},
        "model": {"type": "string", "description": "the served model (GET /v1/models)"},
        "encoding_format": {"enum": [*ENCODINGS, None], "description": "float (the default) "
                            "or base64: little-endian float32"},
        "dimensions": {"type": ["integer", "null"], "minimum": 1, "description": "the first "
                       "that many components, normalized again; at most the hidden size"},
        "user": {"type": ["string", "null"]},
        "pooling": {"enum": [*POOLINGS, None], "description": "extension: mean over the "
                    "prompt's tokens (the default) or the last token's hidden state"},
    }  # fmt: skip
    assert set(properties) == FIELDS
    return {"type": "object", "required": ["model", "input"],
            "properties": dict(sorted(properties.items())),
            "additionalProperties": False}  # fmt: skip


def openapi_path(errors: dict[str, Any]) -> dict[str, Any]:
    """The /v1/embeddings path item, with the error answers `errors` (openapi.py's)."""
    item = {"type": "object", "required": ["object", "index", "embedding"], "properties": {
        "object": {"const": "embedding"}, "index": {"type": "integer"},
        "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}},
                                {"type": "string"}]}}}  # fmt: skip
    answer = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": item},
        "model": {"type": "string"}, "usage": {"type": "object"}}}  # fmt: skip
    return {"post": {
        "summary": "Embeddings: the served model's final hidden states, pooled and normalized",
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": "#/components/schemas/EmbeddingRequest"}}}},
        "responses": {"200": {"description": "one embedding per input, in order",
                              "content": {"application/json": {"schema": answer}}}, **errors},
    }}  # fmt: skip
