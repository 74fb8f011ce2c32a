"""Grammar-constrained decoding: json_schema, regex and ebnf outputs match their grammar,
on greedy and sampled rows, resumed or batched with plain requests."""

from __future__ import annotations

import json
import re

import pytest
import torch

from gpu_worker import Engine
from jobs.field_error import FieldError
from jobs.sampling_params import SamplingParams

GREEDY = {"temperature": 0, "max_new_tokens": 48}
KINDS = ["cat", "dog", "parrot"]
PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "pet": {
            "type": "object",
            "properties": {
                "kind": {"enum": KINDS},
                "age": {"type": "integer", "minimum": 0, "maximum": 99},
                "toys": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 8},
                    "maxItems": 2,
                },
            },
            "required": ["kind", "age", "toys"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "pet"],
    "additionalProperties": False,
}
JSON_PARAMS = {"json_schema": json.dumps(PET_SCHEMA)}
PET_CHAT = [{"role": "user", "content": "Describe a pet owner and their pet as JSON."}]
PHONE = r"[0-9]{3}-[0-9]{4}"


@pytest.fixture(scope="module")
def engine():
    return Engine("smollm2-135m-instruct", dtype="float32")


def assert_valid_pet(text: str) -> None:
    """PET_SCHEMA, checked by hand (jsonschema is not a dependency)."""
    doc = json.loads(text)
    assert set(doc) == {"name", "pet"}, doc
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 12
    pet = doc["pet"]
    assert set(pet) == {"kind", "age", "toys"}, pet
    assert pet["kind"] in KINDS
    assert isinstance(pet["age"], int) and not isinstance(pet["age"], bool)
    assert 0 <= pet["age"] <= 99
    assert isinstance(pet["toys"], list) and len(pet["toys"]) <= 2
    assert all(isinstance(toy, str) and len(toy) <= 8 for toy in pet["toys"])


def run_to_end(engine: Engine, req) -> None:
    engine.scheduler.add_request(req)
    while not req.finished:
        engine._step()


def test_json_schema_greedy_output_parses_and_validates(engine):
    out = engine.generate(messages=PET_CHAT, sampling_params=dict(GREEDY, **JSON_PARAMS))
    assert out["finish_reason"] == "stop", out
    assert_valid_pet(out["text"])


def test_regex_output_fully_matches(engine):
    out = engine.generate(
        messages=[{"role": "user", "content": "Give me a phone number."}],
        sampling_params=dict(GREEDY, regex=PHONE),
    )
    assert re.fullmatch(PHONE, out["text"]), out["text"]
    assert out["finish_reason"] == "stop"


def test_ebnf_output_is_one_of_the_alternatives(engine):
    out = engine.generate(
        messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        sampling_params=dict(GREEDY, ebnf='root ::= "yes" | "no"'),
    )
    assert out["text"] in ("yes", "no")
    assert out["finish_reason"] == "stop"


def test_grammar_rows_leave_plain_rows_in_the_batch_untouched(engine):
    plain = ["The capital of France is", "Once upon a time"]
    alone = [out["output_ids"] for out in engine.generate(plain, GREEDY)]
    # Plain rows first, so a mask landing on the wrong rows would hit them.
    prompts = [*plain, "Describe a pet as JSON:", "Phone:"]
    params = [GREEDY, GREEDY, dict(GREEDY, **JSON_PARAMS), dict(GREEDY, regex=PHONE)]
    outs = engine.generate(prompts, params)
    assert [out["output_ids"] for out in outs[:2]] == alone
    assert_valid_pet(outs[2]["text"])
    assert re.fullmatch(PHONE, outs[3]["text"])


def test_resumed_grammar_request_continues_to_the_same_output(engine):
    ids = engine.tokenizer.encode(PET_CHAT[0]["content"])
    params = SamplingParams.from_dict(dict(GREEDY, **JSON_PARAMS))
    full = engine.build_request("full", ids, params)
    run_to_end(engine, full)
    assert len(full.output_ids) > 8
    k = len(full.output_ids) // 2
    resumed = engine.build_request("resumed", ids, params, output_ids=full.output_ids[:k])
    run_to_end(engine, resumed)
    assert resumed.output_ids == full.output_ids
    assert resumed.finished_reason == full.finished_reason


def test_resume_with_output_the_grammar_refuses_is_a_field_error(engine):
    params = SamplingParams.from_dict(dict(GREEDY, regex=PHONE))
    not_digits = engine.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(FieldError) as caught:
        engine.build_request("bad", [1, 2, 3], params, output_ids=not_digits)
    assert caught.value.field == "output_ids"


def test_sampled_json_schema_outputs_always_parse(engine):
    params = [dict(JSON_PARAMS, temperature=1.0, max_new_tokens=48, seed=seed) for seed in range(4)]
    outs = engine.generate([PET_CHAT[0]["content"]] * 4, params)
    for out in outs:
        assert out["finish_reason"] == "stop", out
        assert_valid_pet(out["text"])


COPY_PET = '{"name":"Ann","pet":{"kind":"cat","age":3,"toys":["ball","yarn"]}}'


def test_grammar_requests_draft_ngrams_and_keep_the_greedy_output(engine):
    spec = Engine("smollm2-135m-instruct", dtype="float32", speculative="ngram")
    prompts = [f"Copy this JSON exactly: {COPY_PET}\nCopy: ", "Count: one two three one two three",
               "Phone: 555-1234. Again, phone: 555-1234. Phone:"]  # fmt: skip
    params = [dict(GREEDY, **JSON_PARAMS), GREEDY, dict(GREEDY, regex=PHONE)]
    outs = spec.generate(prompts, params)
    plain = engine.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    assert_valid_pet(outs[0]["text"])
    assert re.fullmatch(PHONE, outs[2]["text"])
    # The JSON request drafted from its prompt, and the grammar kept what matched.
    assert outs[0]["usage"]["accepted_draft_tokens"] > 0, outs[0]["usage"]


def test_a_draft_model_drafts_under_the_grammar_and_keeps_the_greedy_output(engine):
    # The model as its own draft: drafted under the same mask, every draft is accepted.
    spec = Engine(
        "smollm2-135m-instruct", dtype="float32", speculative="draft",
        draft_model="smollm2-135m-instruct", num_draft_tokens=4,
    )  # fmt: skip
    prompts = [PET_CHAT[0]["content"], "Phone:", "Count: one two three"]
    params = [dict(GREEDY, **JSON_PARAMS), dict(GREEDY, regex=PHONE), GREEDY]
    outs = spec.generate(prompts, params)
    plain = engine.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    assert_valid_pet(outs[0]["text"])
    drafter = spec.scheduler.drafter
    assert outs[0]["usage"]["accepted_draft_tokens"] > 0, outs[0]["usage"]
    # Nothing drafted past a grammar's end either.
    assert drafter.accepted == drafter.drafted


def test_a_verify_rows_mask_follows_the_drafts_before_it(engine):
    from gpu_worker.sampling.grammar import GrammarMask

    grammars = engine.grammars
    matcher = grammars.matcher(SamplingParams(json_schema=json.dumps(PET_SCHEMA)))
    drafts = engine.tokenizer.encode(COPY_PET)[:5]
    assert matcher.validate_tokens(drafts) == len(drafts)
    rows = [drafts[:j] for j in range(len(drafts) + 1)]
    mask = GrammarMask.build([matcher] * len(rows), engine.vocab_size, "cpu", rows)
    for j, before in enumerate(rows):
        fresh = grammars.matcher(SamplingParams(json_schema=json.dumps(PET_SCHEMA)))
        assert fresh.consume_tokens(before)
        expected = GrammarMask.build([fresh], engine.vocab_size, "cpu")
        assert torch.equal(mask.bitmask[j], expected.bitmask[0])
    # The matcher is back where it was: it takes the first draft again.
    assert matcher.consume_token(drafts[0])


def test_verify_rows_past_the_grammars_end_are_left_unmasked(engine):
    from gpu_worker.sampling.grammar import GrammarMask

    matcher = engine.grammars.matcher(SamplingParams(regex=PHONE))
    drafts = engine.tokenizer.encode("555-1234") + [engine.tokenizer.eos_token_id]
    rows = [drafts[:j] for j in range(len(drafts) + 1)]
    mask = GrammarMask.build([matcher] * len(rows), engine.vocab_size, "cpu", rows)
    # The last digit completes the grammar: the request ends there, whatever its later rows.
    assert (mask.bitmask[-1] == -1).all() and not (mask.bitmask[0] == -1).all()
    assert matcher.consume_token(drafts[0])  # rolled back to where it was


def test_grammar_on_a_model_without_tokenizer_is_a_field_error():
    tiny = Engine("random:tiny-llama", dtype="float32")
    with pytest.raises(FieldError, match="no tokenizer") as caught:
        tiny.generate(input_ids=[1, 2, 3], sampling_params={"regex": PHONE, "max_new_tokens": 4})
    assert caught.value.field == "regex"


def test_retracted_grammar_request_keeps_its_matcher_state(engine):
    prompts = ["Name some animals:", "List colours:", "Say words:", "Fruit names:"]
    params = {"temperature": 0, "max_new_tokens": 24, "regex": "[a-z ]+"}
    roomy = [out["output_ids"] for out in engine.generate(prompts, params)]
    longest = max(len(engine.tokenizer.encode(p)) for p in prompts) + 24
    # Room for one request and two slots: decode must retract and recompute the others.
    small = Engine("smollm2-135m-instruct", dtype="float32", max_total_tokens=longest + 2)
    outs = small.generate(prompts, params)
    assert small.scheduler.num_retractions > 0
    assert [out["output_ids"] for out in outs] == roomy
    assert all(re.fullmatch("[a-z ]+", out["text"]) for out in outs)


def test_a_batch_of_grammar_rows_filled_in_parallel_matches_them_one_by_one(engine):
    from gpu_worker.sampling.grammar import PARALLEL_FILL_ROWS

    prompts = [f"Phone number {i}:" for i in range(PARALLEL_FILL_ROWS + 1)]
    params = [dict(GREEDY, regex=PHONE)] * len(prompts)
    together = engine.generate(prompts, params)
    for prompt, out in zip(prompts, together, strict=True):
        assert re.fullmatch(PHONE, out["text"])
        assert out["output_ids"] == engine.generate(prompt, params[0])["output_ids"]


# A regex whose lexer outgrows llguidance's expression budget within two masks: the first
# is computed as it compiles, the second fails ("too many expressions constructed").
OUTGROWN = "(a{1000}){1000}"


def test_a_grammar_past_llguidances_limits_is_refused_and_the_engine_serves_on(engine):
    """It ended with a bare end-of-sequence and "stop" (a matcher in error masks all but
    it), then, once its lexer was exhausted, did the same for every later copy."""
    for _ in range(2):  # the second time from a fresh compile, not a poisoned template
        with pytest.raises(FieldError, match="lexer error") as caught:
            engine.generate("a", {"regex": OUTGROWN, "max_new_tokens": 4})
        assert caught.value.field == "regex" and "\n" not in str(caught.value)
    out = engine.generate("Phone:", dict(GREEDY, regex=PHONE))
    assert re.fullmatch(PHONE, out["text"])


def test_a_matcher_in_error_that_takes_end_of_sequence_is_an_error_not_an_end(engine):
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from gpu_worker.sampling.grammar import _template, consume

    template = _template(engine.grammars._llg_tokenizer(), "regex", OUTGROWN)
    matcher = template.deep_copy()
    mask = allocate_token_bitmask(1, engine.vocab_size)
    fill_next_token_bitmask(matcher, mask, 0)
    eos = min(engine.eos_ids)
    assert matcher.is_error() and mask[0][eos // 32] >> (eos % 32) & 1  # only EOS is allowed
    assert consume(matcher, eos).startswith("lexer error: too many expressions")


def test_a_grammar_that_outgrows_the_matcher_mid_answer_ends_the_request_as_an_error(engine):
    """Its first masks pass admission; property b's lexeme exhausts the lexer once the answer
    reaches it. The request ends with reason "error" naming the field (readers answer a
    400), where it ended "abort" with the text cut short and no word to an OpenAI client."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
              "b": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    params = SamplingParams.from_dict(dict(GREEDY, json_schema=json.dumps(schema)))
    req = engine.build_request("mid", engine.tokenizer.encode("JSON please"), params)
    run_to_end(engine, req)
    reason = req.finished_reason
    assert (reason.kind, reason.param) == ("error", "json_schema")
    assert reason.matched.startswith("json_schema cannot be followed further: lexer error")
    assert 0 < len(req.output_ids) < GREEDY["max_new_tokens"]
