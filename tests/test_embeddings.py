"""Embeddings in the engine (gpu_worker/scheduling/pooling.py) equal transformers' final hidden
states for the same weights, pooled and L2-normalized, on a small random Llama in float32:
whole or in prefill chunks, batched with a generation, after a prefix the cache holds (an
embedding computes every position it pools), and with either pooling. On the wire: a job's
``pooling`` and a reply's packed float32 vector travel, through the detokenizer, and bad
ones are protocol errors."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
import torch
import transformers

from bus.actor import Inbound
from gpu_worker import Engine
from jobs.field_error import FieldError
from jobs.protocol import (
    Finish,
    GenerateRequest,
    ProtocolError,
    TextDelta,
    TokenBatch,
    TokenItem,
    TokenizedRequest,
    decode,
    encode,
)
from jobs.token_records import pack_floats
from runtime.config import BusConfig
from stages.detokenizer.stage import DetokenizerStage
from tests.tiny_configs import tiny_shape

VOCAB = 256
TOLERANCE = 1e-5  # float32, another summation order
SHAPE = tiny_shape(VOCAB, 64, 128, layers=2, heads=4, kv_heads=2, max_position_embeddings=256,
                   initializer_range=0.2, tie_word_embeddings=False)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # not ones: pooled before the final norm would then differ
        model.model.norm.weight.normal_(1.0, 0.5)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path), model


def _reference(model, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last hidden state (after the final norm), pooled and normalized."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
    pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(pooled, dim=0)


def _close(got: list[float], expected: torch.Tensor) -> None:
    assert len(got) == expected.shape[0]
    assert torch.tensor(got).norm().item() == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(torch.tensor(got), expected, atol=TOLERANCE, rtol=0)


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 40, 130)]


@pytest.mark.parametrize("chunk", [2048, 16], ids=["whole", "chunked"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_transformers_hidden_states(tiny_model, chunk, pooling):
    path, model = tiny_model
    engine = Engine(path, dtype="float32", chunked_prefill_size=chunk, page_size=4)
    prompts = _prompts()
    vectors = engine.embed(input_ids=prompts, pooling=pooling)
    for got, ids in zip(vectors, prompts, strict=True):
        _close(got, _reference(model, ids, pooling))


def test_a_cached_prefix_does_not_change_an_embedding(tiny_model):
    path, model = tiny_model
    engine = Engine(path, dtype="float32", page_size=4)
    shared = _prompts()[3]
    engine.generate(input_ids=shared[:100], sampling_params={"max_new_tokens": 1})
    assert engine.generate(input_ids=shared, sampling_params={"max_new_tokens": 1}
                           )["usage"]["cached_tokens"] > 0  # fmt: skip
    _close(engine.embed(input_ids=shared), _reference(model, shared, "mean"))
    # And its pages are cached afterwards, like any prefill's.
    hit = engine.generate(input_ids=shared + [7, 8], sampling_params={"max_new_tokens": 1})
    assert hit["usage"]["cached_tokens"] >= 128


def test_an_embedding_batched_with_a_generation_leaves_both_unchanged(tiny_model):
    path, model = tiny_model
    engine = Engine(path, dtype="float32", chunked_prefill_size=64, page_size=4)
    prompts = _prompts()
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    alone = engine.generate(input_ids=prompts[2], sampling_params=greedy)["output_ids"]
    engine.flush_cache()
    # Queued together: the generation's prefill and the embedding's first chunk share the
    # first forward (the embedding's prompt is the longer, so it is the one chunked).
    params = engine.sampling_params(greedy, len(prompts[2]))
    generation = engine.build_request("gen", prompts[2], params)
    engine.scheduler.add_request(generation)
    vector = engine.embed(input_ids=prompts[3], pooling="mean")
    while not generation.finished:
        engine.scheduler.step()
    assert generation.output_ids == alone
    _close(vector, _reference(model, prompts[3], "mean"))


def test_bad_embedding_requests_are_refused(tiny_model):
    engine = Engine(tiny_model[0], dtype="float32")
    with pytest.raises(FieldError, match="pooling"):
        engine.embed(input_ids=[1, 2], pooling="max")
    with pytest.raises(FieldError, match="vocabulary"):
        engine.embed(input_ids=[VOCAB])
    with pytest.raises(FieldError, match="context length"):
        engine.embed(input_ids=[1] * 257)
    assert len(engine.embed(input_ids=[1] * 256)) == SHAPE["hidden_size"]  # the whole context


# ---- on the wire ----------------------------------------------------------------------------


def test_a_jobs_pooling_and_a_replys_vector_survive_the_wire():
    job = GenerateRequest("r-0", "reply:x", prompt="hi", sampling={"max_new_tokens": 0},
                          pooling="last")  # fmt: skip
    assert decode(encode(job), GenerateRequest).pooling == "last"
    tokenized = TokenizedRequest("r-0", "reply:x", [1, 2], {"max_new_tokens": 0}, pooling="mean")
    assert decode(encode(tokenized), TokenizedRequest).pooling == "mean"
    vector = [0.6, -0.8, 0.0]
    item = TokenItem("r-0", "reply:x", 0, [], [], 0, finish=Finish("stop", None, 2, 0),
                     bundle=True, embedding=pack_floats(vector))  # fmt: skip
    batch = decode(encode(TokenBatch("w0", 1, [item])), TokenBatch)
    # The detokenizer passes the vector on as it is, beside the finish.
    (delta,) = (
        DetokenizerStage(BusConfig(), None).handle([Inbound(b"1-0", batch)])[0].message.deltas
    )
    assert np.frombuffer(delta.embedding, "<f4").tolist() == pytest.approx(vector)
    assert delta.finish_info().prompt_tokens == 2


@pytest.mark.parametrize(
    "message, accepted",
    [
        (GenerateRequest("r", "x", prompt="hi"), GenerateRequest),
        (TokenizedRequest("r", "x", [1], {}), TokenizedRequest),
    ],
)
def test_an_unknown_pooling_is_a_protocol_error_naming_it(message, accepted):
    wire = {**message.to_wire(), "pooling": "max"}
    with pytest.raises(ProtocolError, match="pooling") as caught:
        decode(msgpack.packb(wire), accepted)
    assert caught.value.field == "pooling"


def test_a_vector_that_is_not_whole_float32s_is_a_protocol_error():
    delta = {**TextDelta("r", 0, []).to_wire(), "embedding": b"\x00" * 5}
    with pytest.raises(ProtocolError, match="multiple of 4"):
        decode(msgpack.packb(delta), TextDelta)
