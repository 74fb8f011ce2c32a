"""Tool calls in the model's text (jobs/tool_format.py, stages/ingress/api/tool_call_parser.py)
and in the prompt (the tokenizer stage): the parser gives the same content and calls however
the text is cut into stream pieces; a template that renders tools gets them as transformers
gives them, and one that does not gets the stand-in system prompt and the Hermes text."""

from __future__ import annotations

import json
import shutil

import pytest

from jobs.field_error import FieldError
from jobs.grammar import grammar_problem
from jobs.model_tokenizer import cached_tokenizer_folder, load_model_tokenizer
from jobs.tool_format import call_text
from runtime.model_files import default_gguf_path
from stages.ingress.api.params import parse_chat
from stages.ingress.api.tool_call_parser import ToolCallParser
from stages.ingress.api.tool_request import tool_calling

NAMES = {"get_weather", "get_time"}
PARIS = call_text("get_weather", {"city": "Paris"})
ROME_AS_TEXT = (
    '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>'
)

# (the model's text, the content, the calls as (name, arguments))
TEXTS = [
    ("Just text, no calls.\n", "Just text, no calls.\n", []),
    (f"{PARIS}\n{ROME_AS_TEXT}\n", "", [("get_weather", {"city": "Paris"}),
                                        ("get_time", {"zone": "CET"})]),
    (f"Let me look.\n{PARIS}", "Let me look.", [("get_weather", {"city": "Paris"})]),
    (f"{PARIS}\nDone.", "Done.", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', []),
    ("<tool_call>{not json</tool_call> and <tool", "<tool_call>{not json</tool_call> and <tool",
     []),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', "",
     [("get_time", {"zone": "UTC"})]),  # stopped before the closing tag
    # Parallel calls cut off by max_tokens: the unfinished one leaves no markup behind.
    (f'{PARIS}\n{PARIS}\n<tool_call>\n{{"name": "get_wea', "",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),
    (f"{PARIS}\n<tool_call>\n{{not json</tool_call>", "", [("get_weather", {"city": "Paris"})]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), TEXTS)
@pytest.mark.parametrize("piece", [1, 2, 5, 13, 10_000])
def test_the_parser_splits_content_and_calls_however_the_text_streams(text, content, calls,
                                                                      piece):  # fmt: skip
    parser = ToolCallParser(NAMES, "x0")
    got_content, got_calls = "", []
    for start in range(0, len(text), piece):
        part, done = parser.feed(text[start : start + piece], final=start + piece >= len(text))
        got_content += part
        got_calls += done
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"call_x0_{i}" for i in range(len(calls))]


def test_the_grammar_of_required_and_of_a_named_function_compiles():
    tools = [{"type": "function", "function": {"name": n}} for n in sorted(NAMES)]
    required = tool_calling({"tools": tools, "tool_choice": "required"})
    get_time = {"type": "function", "function": {"name": "get_time"}}
    named = tool_calling({"tools": tools, "tool_choice": get_time})
    single = tool_calling({"tools": tools, "tool_choice": "required",
                           "parallel_tool_calls": False})  # fmt: skip
    auto = tool_calling({"tools": tools})  # any text, but a call it opens is a tool's
    assert tool_calling({"tools": tools, "tool_choice": "none"}) is None
    for calling in (required, named, single, auto):
        assert grammar_problem("ebnf", calling.grammar()) is None
    assert 'call ("\\n" call)*' in required.grammar()
    assert "start: call\n" in named.grammar() and "get_weather" not in named.grammar()
    assert "start: call\n" in single.grammar()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
]  # fmt: skip
# A Hermes-style template that renders tools, calls and results itself.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def smollm_tokenizer():
    tokenizer = load_model_tokenizer("smollm2-135m-instruct")
    assert tokenizer is not None
    return tokenizer


def test_a_template_without_tools_gets_them_as_a_system_prompt(smollm_tokenizer):
    text = smollm_tokenizer.render_chat(HISTORY, [WEATHER])
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert json.dumps(WEATHER) in text
    assert f"<|im_start|>assistant\n{call_text('get_weather', {'city': 'Paris'})}<|im_end|>" in text
    assert '<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response>' in text
    # Without tools the history is still the Hermes text, and no tools are announced.
    assert "You may call" not in smollm_tokenizer.render_chat(HISTORY)


def test_a_template_with_tools_renders_them_as_transformers_does(smollm_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    source = cached_tokenizer_folder(default_gguf_path())
    folder = tmp_path / "tools-template"
    shutil.copytree(source, folder)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    reference = AutoTokenizer.from_pretrained(str(folder))
    expected = reference.apply_chat_template(HISTORY, tools=[WEATHER], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    tokenizer = load_model_tokenizer(str(folder))
    assert tokenizer.render_chat(HISTORY, [WEATHER]) == expected
    assert "Tools:" in expected and "<tool_call>" in expected


def test_a_direct_job_with_malformed_tool_calls_is_a_field_error(smollm_tokenizer):
    broken = [{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}]
    with pytest.raises(FieldError, match="tool call needs") as caught:
        smollm_tokenizer.render_chat(broken, [WEATHER])
    assert caught.value.field == "messages"


def test_auto_beside_a_response_format_leaves_the_grammar_to_the_format():
    messages = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    auto = parse_chat({"model": "m", "messages": messages, "tools": tools}, "m")
    formatted = parse_chat({"model": "m", "messages": messages, "tools": tools,
                            "response_format": {"type": "json_object"}}, "m")  # fmt: skip
    assert "ebnf" in auto.sampling and "json_schema" not in auto.sampling
    assert "json_schema" in formatted.sampling and "ebnf" not in formatted.sampling
